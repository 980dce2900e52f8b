"""mp_toolkit: pipeline and tensor model-parallel training for Transformers."""
__version__ = "0.1.0"
