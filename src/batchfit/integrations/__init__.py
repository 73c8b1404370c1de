"""batchfit inside the libraries people train with: each module sizes one library's run from memory.

One module per library (TRL, the Hugging Face ``Trainer``, Lightning); each imports its library
only inside the functions that need it, so ``import batchfit.integrations`` works without any of
them installed. Install a library's extra from batchfit's checkout (``pip install -c constraints-cpu.txt -e '.[trl]'``,
``'.[hf]'``, ``'.[lightning]'``; without ``-c`` on a GPU machine) to use its module. Every fact about such a library (its config's rules,
how it splits and pads a batch) lives in its module here, cited from its code, as the RL
frameworks' facts live in :mod:`batchfit.frameworks`. See ``docs/integrations.md`` and ``docs/trl.md``.
"""
