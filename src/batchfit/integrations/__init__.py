"""Where users live: batchfit's budgets applied to other training libraries (TRL, the Hugging Face Trainer, Lightning).

One module per library. Each imports its library only inside the functions that need it, so
``import batchfit.integrations`` works without any of them installed; install the extra
(``pip install batchfit[trl]``) of the one you use. Every fact about a library (its config's
rules, how it splits and pads a batch) lives in that library's module, cited from its code.
"""
