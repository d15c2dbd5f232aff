"""The parts every engine shares, behind the contract (backend/__init__.py):

    output     one sequence's output bookkeeping: endings, safe text, the Finish
    text       complete UTF-8 and stop sequences held back
    logprobs   one step's log-probabilities, the same way for every engine
    fairness   who goes next when callers share an engine (both schedulers' policy)
    ledger     what an engine served and refused, per caller and in all, counted once
    stats      EngineStats, the snapshot the ledger publishes
    chat       a model's chat template, rendered as Hugging Face renders it
    tokens     helpers over token id sequences
    models     where the default model comes from (fetched through pip, with progress)
"""
