"""What both exllama generations share, written once: the core that drives a dynamic generator on the
engine thread (core), its queue with shedding, fairness and preemption (job_queue, preemption), a
request's samples as jobs (job, job_fields), result dicts as events (results), the figures (figures),
the grammar filter over our llguidance matchers (grammar_filter), the token bias and DRY breakers both
samplers take (sampling), and the model folder's files and vocabulary (model_files, vocabulary). Each
generation is a thin binding beside it (binding.py says what one gives): backend.exllamav2 (EXL2, GPTQ,
FP16) and backend.exllamav3 (EXL3, FP16, BF16).

Nothing here imports either library: the bindings' engines do, when they start.
"""
