"""Integrations of bcg with serving loops written elsewhere.

* :mod:`bcg.integrations.transformers`: Hugging Face ``transformers``' continuous batching
  (``model.generate_batch``, ``ContinuousBatchingManager``) replaying its forward through a
  :class:`bcg.GraphRunner`.

Each integration imports its library lazily: importing ``bcg`` never imports it.
"""
