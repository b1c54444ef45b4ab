"""examples/hf_llama.py on a GPU: a Hugging Face Llama under bcg, bit-identical to eager, timed.

Skips (with the reason) where ``transformers`` is not importable, and, as every
``cuda`` test, where no GPU is.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_llama.py"


def _load_example():
    """examples/ is no package: load hf_llama.py from its path, once."""
    name = "bcg_example_hf_llama"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    assert spec is not None and spec.loader is not None, f"cannot load {EXAMPLE}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def test_hf_llama_example_is_bit_identical_and_timed() -> None:
    pytest.importorskip(
        "transformers",
        reason="transformers is not importable (pip install transformers): examples/hf_llama.py needs it",
    )
    example = _load_example()
    r = example.main(["--tokens", "256", "--requests", "3", "--layers", "2", "--iters", "10"])
    assert r["device"].startswith("cuda") and r["mode"] == "graph"
    assert r["packed_ok"], f"packed attention vs HF sdpa per request: rel err {r['packed_rel_err']}"
    assert r["graph_equal"] is True
    assert r["segments"] == 3 and r["breakpoints"] == 2
    assert r["runner_equal"] is True
    assert r["runner_bucket"] != r["runner_tokens"]  # the call really was padded
    assert r["runner_fallbacks"] == {"too_large": 0, "padding_waste": 0, "capture_failed": 0, "not_captured_yet": 0, "capture_busy": 0, "staged_unfit": 0}
    for key in ("eager_ms", "bcg_ms", "speedup", "runner_eager_ms", "runner_ms", "runner_speedup"):
        assert r[key] > 0, key
    torch.cuda.synchronize()


def test_hf_llama_example_compiled_whole_is_bit_identical_to_the_compiled_model() -> None:
    """--compile: the whole HF model compiled with fullgraph=True, the attention breakpoint one op
    inside; make_graph and the runner replay Inductor's kernels bit-identically to the compiled
    model run eagerly."""
    pytest.importorskip(
        "transformers",
        reason="transformers is not importable (pip install transformers): examples/hf_llama.py needs it",
    )
    torch._dynamo.reset()
    example = _load_example()
    r = example.main(["--tokens", "256", "--requests", "3", "--layers", "2", "--iters", "5", "--compile"])
    assert r["compiled"] and r["mode"] == "graph"
    assert r["graph_equal"] is True and r["runner_equal"] is True
    assert r["segments"] == 3 and r["breakpoints"] == 2  # the op still ends a segment in the capture
    assert r["dynamo_graphs"] >= 1
    torch._dynamo.reset()


def test_hf_llama_decode_example_decodes_through_staged_graphs_like_eager() -> None:
    """examples/hf_llama_decode.py: greedy decoding over a paged cache through a runner of batch
    buckets (staged attention, requests finishing at different steps) gives the eager tokens."""
    pytest.importorskip("transformers", reason="transformers is not importable: the example needs it")
    path = EXAMPLE.parent / "hf_llama_decode.py"
    spec = importlib.util.spec_from_file_location("bcg_example_hf_llama_decode", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = module.main(["--requests", "5", "--steps", "6", "--layers", "2"])
    assert r["device"].startswith("cuda") and r["mode"] == "graph"
    assert r["tokens_equal"] and r["logits_close"]
    assert r["fallbacks"] == dict.fromkeys(r["fallbacks"], 0)
