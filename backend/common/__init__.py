"""The parts every engine shares (the contract, backend/__init__.py, exports what callers need of them):

    core          what every engine core keeps: the outbox, the step count, the ledger, `cancel` once
    door          admission at submit: one bounded capacity callers share, and each caller's limit
    fairness      who goes next when callers share an engine (both schedulers' policy)
    output        one sequence's output bookkeeping: endings, safe text, the Finish
    clock         one sequence's clock: its timings and deadline
    text          complete UTF-8 and stop sequences held back
    logprobs      one step's log-probabilities, the same way for every engine
    ledger        what an engine served and refused, per caller and in all, counted once
    stats         EngineStats, the snapshot the ledger publishes
    cache_events  KV-cache events: which prompt prefixes a replica holds, for a router
    chat          a model's chat template, rendered as Hugging Face renders it
    tokens        helpers over token id sequences
    models        where the default model comes from (fetched through pip, with progress)
    progress      a long first-run step's progress: a bar in a terminal, lines in logs
"""
