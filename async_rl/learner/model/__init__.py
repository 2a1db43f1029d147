"""The torch backend's model and its kernels: the chunked output head and its kernels (`head.py`;
compiled `head_fused.py`, Triton `head_triton.py`, the start-up probe `head_probe.py`), attention over
packed micro-batches (`attention.py`, FlexAttention's mask `attention_flex.py`), the bf16 working
copy (`precision.py`), the decoder-layer kernels (`kernels.py`: Liger, compile) and LoRA (`lora.py`).
Megatron's model lives in `learner/megatron/` and borrows the head and attention from here."""
