"""batchfit inside the libraries people train with: each module sizes one library's run from memory.

One module per library (the Hugging Face ``Trainer``, Lightning, ...); each imports its library
only when used, so ``import batchfit`` never needs them. Install a library's extra
(``pip install 'batchfit[hf]'``, ``'batchfit[lightning]'``) to use its module. Every fact about
such a library lives in its module here, as the RL frameworks' facts live in
:mod:`batchfit.frameworks`. See ``docs/integrations.md``.
"""
