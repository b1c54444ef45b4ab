"""Multi-GPU: ranks that agree on what every call replays, and fail captures together."""

from bcg.distributed.agreement import CaptureVote, RankAgreement, replay_on_ranks

__all__ = ["CaptureVote", "RankAgreement", "replay_on_ranks"]
