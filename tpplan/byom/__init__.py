"""Bring your own model: plans for models tpplan does not ship, and weights out to others.

``suggest`` (a plan inferred from a model's traced dataflow), ``import_hf`` (the
``base_model_tp_plan`` transformers ships, made a full plan) and ``export`` (a sharded
checkpoint as one safetensors file that transformers or tpplan loads). Imports the plan,
models, parallel and checkpoint layers and the façade; not the trainer or the analyses.
"""
