"""moe-fold: Mixture-of-Experts pretraining with MoE parallel folding."""

__version__ = "0.1.0"
