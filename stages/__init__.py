"""The pipeline's stages. A CUDA torchvision beside a CPU torch (what the `vllm` extra installs from PyPI)
is hidden before anything here imports transformers (transfer/compat/vllm_api.py)."""
from transfer.compat.vllm_api import hide_cuda_media

hide_cuda_media()
