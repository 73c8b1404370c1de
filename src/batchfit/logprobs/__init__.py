"""Memory-bounded per-token log-probs and entropy for RL losses over large vocabularies.

Materialising ``[batch, seq, vocab]`` fp32 logits, their softmax and its gradient is what runs
out of memory at long context (SkyRL #1610). Two paths avoid it:

- :func:`logprobs_from_logits` / :func:`entropy_from_logits`: the logits exist (the model made
  them); reduce them ``chunk_size`` tokens at a time in fp32 and recompute each chunk's softmax in
  backward. Extra memory O(chunk × V) besides the logits' own gradient.
- :func:`logprobs_from_hidden`: give the last hidden states and the ``lm_head`` weight; the logits
  are projected chunk by chunk and never exist whole. Peak extra memory O(chunk × V), independent
  of sequence length.

All outputs are fp32 of the labels' shape; log-probs and entropy may require grad together
(no in-place writes to saved tensors, SkyRL #1648). See ``docs/logprobs.md``.
"""

from batchfit.logprobs.chunks import IGNORE_INDEX
from batchfit.logprobs.from_hidden import logprobs_from_hidden
from batchfit.logprobs.from_logits import entropy_from_logits, logprobs_from_logits

__all__ = ["IGNORE_INDEX", "entropy_from_logits", "logprobs_from_hidden", "logprobs_from_logits"]
