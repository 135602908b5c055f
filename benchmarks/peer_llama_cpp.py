"""llama.cpp as a batched peer: a greedy loop over llama-cpp-python's low-level `llama_batch` API (its
high-level `Llama` class runs one sequence at a time), and GGUF copies of the default model at other precisions.

Every sequence of a call decodes in one `llama_decode` per step, prompts are prefilled several sequences per
batch, and prompts that share a prefix (the shared-prefix workload) compute it once and copy its KV cells to the
other sequences with `llama_memory_seq_cp`, as llama.cpp's own `parallel` example does with a system prompt.
"""

from __future__ import annotations

import ctypes
import pathlib

import numpy as np

# GGUF precision name -> (tensor type for 2-D weights, general.file_type value).
PRECISIONS = {"F32": ("F32", 0), "BF16": ("BF16", 32)}


def write_gguf_copy(source: pathlib.Path, target: pathlib.Path, precision: str) -> pathlib.Path:
    """The same model with every 2-D weight dequantized and stored as `precision` (F32 or BF16); metadata,
    tokenizer and tensor order unchanged, so llama.cpp reads the weights furcate's float model holds."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    if target.exists():
        return target
    tensor_type, file_type = PRECISIONS[precision]
    reader = GGUFReader(source)
    partial = target.with_suffix(".partial")
    writer = GGUFWriter(str(partial), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = file_type if key == "general.file_type" else field.contents()
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    qtype = GGMLQuantizationType[tensor_type]
    for tensor in reader.tensors:
        weights = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if weights.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, quantize(weights, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, weights)
    return finish_gguf(writer, partial, target)


def finish_gguf(writer, partial: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """Write out a GGUFWriter's file under its temporary name, then move it into place whole."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


class LlamaCppBatched:
    """Greedy decoding of many sequences at once on one llama.cpp context."""

    def __init__(self, gguf: str, threads: int, n_ctx: int, n_seq: int, n_batch: int = 2048) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        # On AMX CPUs llama.cpp (0.3.36) repacks quantized weights for its AMX kernels, whose matmul segfaults on
        # any batch of more than one token; its plain CPU kernels run instead.
        self.extra_bufts = "amx_tile" not in pathlib.Path("/proc/cpuinfo").read_text()
        model_params.use_extra_bufts = self.extra_bufts
        self.model = lc.llama_model_load_from_file(gguf.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        params.n_seq_max, params.kv_unified = n_seq, True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (n_ctx too large?)")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants logits). Returns the argmax of each wanted row."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        batch.n_tokens = len(entries)
        if self.lc.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")
        return [self._argmax(i) for i, entry in enumerate(entries) if entry[3]]

    def _argmax(self, row: int) -> int:
        pointer = self.lc.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)),
                                         shape=(self.n_vocab,)).argmax())

    def _prefill(self, jobs: list[tuple[int, list[int], int]]) -> dict[int, int]:
        """jobs: (sequence, tokens, first position). Packs them into batches of up to n_batch tokens; returns
        each sequence's next token (from its last prompt token's logits)."""
        entries = [(token, start + i, seq, i == len(tokens) - 1)
                   for seq, tokens, start in jobs for i, token in enumerate(tokens)]
        owners = [seq for seq, tokens, _ in jobs]
        firsts: list[int] = []
        for begin in range(0, len(entries), self.n_batch):
            firsts += self._decode(entries[begin : begin + self.n_batch])
        return dict(zip(owners, firsts))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, shared_prefix: list[int] | None = None,
                 ) -> list[list[int]]:
        """Greedy continuations of every prompt, all decoded together. shared_prefix[i]: how many leading
        tokens prompt i shares with the first prompt of its group (prompts sharing one prefix must be given
        together, the group's first prompt first); those are computed once and copied."""
        lc = self.lc
        memory = lc.llama_get_memory(self.ctx)
        lc.llama_memory_clear(memory, True)
        shared = shared_prefix or [0] * len(prompts)
        owner: dict[tuple[int, ...], int] = {}
        jobs = []
        for seq, (prompt, n_shared) in enumerate(zip(prompts, shared)):
            key = tuple(prompt[:n_shared])
            if n_shared and key in owner:
                jobs.append((seq, prompt[n_shared:], n_shared, owner[key]))
            else:
                owner.setdefault(key, seq)
                jobs.append((seq, prompt, 0, None))
        # Group leaders first (whole prompts), then the others' suffixes on top of a copy of the prefix.
        next_token = self._prefill([(seq, tokens, start) for seq, tokens, start, src in jobs if src is None])
        for seq, _, start, src in jobs:
            if src is not None:
                lc.llama_memory_seq_cp(memory, src, seq, 0, start)
        next_token.update(self._prefill([(seq, tokens, start) for seq, tokens, start, src in jobs
                                         if src is not None]))
        outputs = [[next_token[seq]] for seq in range(len(prompts))]
        lengths = [len(p) for p in prompts]
        for step in range(1, max_new_tokens):
            entries = [(outputs[seq][-1], lengths[seq] + step - 1, seq, True) for seq in range(len(prompts))]
            for seq, token in enumerate(self._decode(entries)):
                outputs[seq].append(token)
        return outputs
