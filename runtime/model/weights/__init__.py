"""Weight loading: HF directories, GGUF reading and conversion, quantization formats, live weight updates."""
