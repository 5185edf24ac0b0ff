"""The engine: the request (checked arguments), one request's prefill, the scheduler that owns the
model (waiting and running sequences, batched decode, preemption), and the BlendEngine facade.
"""
