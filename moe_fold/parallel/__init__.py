"""Where a model's tensors live across ranks: tensor parallel layers and sequence parallel
(``tensor_parallel``), context parallel attention (``context_parallel``, ``ring_attention``,
``varlen`` for packed documents, ``document_attention`` for the fused document-masked kernel), pipeline stages and schedules (``pipeline``,
``pipeline_schedules``), and the shard of a global tensor each rank holds (``sharding``).
Import from the modules."""
