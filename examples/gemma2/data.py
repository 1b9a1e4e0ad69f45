"""Text -> token stream -> batches. No download: the default corpus is the standard library's
`pydoc_data.topics` (~465 KB of English) under a byte-level tokenizer (ids = byte + 3; pad 0,
eos 1, bos 2 as in Gemma2). A batch is a pure function of (seed, step, dp rank), so resuming at
step N reads exactly the batches an uninterrupted run would have read."""
from __future__ import annotations

import os
from typing import Optional

import torch


class ByteTokenizer:
    """UTF-8 bytes shifted by 3; vocab 259."""
    pad_id, eos_id, bos_id, offset = 0, 1, 2, 3
    vocab_size = 259

    def encode(self, text: str) -> list:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - self.offset for i in ids if i >= self.offset).decode("utf-8", errors="replace")


def default_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")   # what AutoTokenizer loads Gemma's from


def _missing(data: str) -> FileNotFoundError:
    return FileNotFoundError(f"--data {data!r} does not exist; pass a UTF-8 text file or a .pt "
                             "file of token ids (or omit --data for the built-in corpus)")


def read_text(data: Optional[str]) -> str:
    """The text corpus: default_text() for data None, else the UTF-8 file `data` (not empty)."""
    if data is None:
        return default_text()
    if not os.path.isfile(data):
        raise _missing(data)
    try:
        with open(data, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {data!r} is not UTF-8 text ({e.reason} at byte {e.start}); pass a "
                         "UTF-8 text file, or token ids as a .pt file (a name ending in .pt)") from None
    if not text.strip():
        raise ValueError(f"--data {data!r} holds no text; pass a non-empty UTF-8 file")
    return text


def read_token_file(data: str) -> torch.Tensor:
    """The .pt corpus `data`: a non-empty 1-D integer tensor of non-negative ids, as int64."""
    if not os.path.isfile(data):
        raise _missing(data)
    try:
        tokens = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"--data {data!r} could not be read as a torch.save file of a token tensor: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if (not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point()
            or tokens.is_complex() or tokens.dtype == torch.bool):
        raise ValueError(f"--data {data!r} must hold a 1-D integer tensor of token ids, got "
                         f"{type(tokens).__name__} {getattr(tokens, 'dtype', '')} "
                         f"{tuple(getattr(tokens, 'shape', ()))}")
    if tokens.numel() == 0:
        raise ValueError(f"--data {data!r} holds an empty tensor; it needs token ids")
    low = int(tokens.min())
    if low < 0:
        raise ValueError(f"--data {data!r} holds token id {low} at position "
                         f"{int((tokens < 0).nonzero()[0, 0])}; ids must be >= 0")
    return tokens.long()


def check_ids(top: int, vocab_size: int, source: str) -> None:
    """The largest token id `top` must be an embedding row of the model."""
    if top >= vocab_size:
        raise ValueError(f"{source} has token id {top} >= vocab size {vocab_size}; the tokens do not "
                         "match the model config (--config / --model-dir)")


def check_length(n_tokens: int, seq_len: int) -> None:
    """An unpacked row is bos + seq_len corpus tokens at a random offset."""
    if n_tokens <= seq_len:
        raise ValueError(f"the corpus has {n_tokens} tokens, fewer than --seq-len {seq_len} + 1; "
                         "pass a longer --data or a shorter --seq-len")


def check_tokenizer(model_dir: str) -> None:
    """Text is tokenized with model_dir's tokenizer: it must be there (without one, transformers
    quietly builds an empty tokenizer that turns every document into <unk>)."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"--model-dir {model_dir!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}) to turn the "
            "text corpus into token ids; copy the checkpoint's tokenizer files there, or pass --data "
            "as a .pt tensor of token ids")


def check_data(data: Optional[str], *, vocab_size: int, seq_len: int, pack: bool,
               model_dir: Optional[str] = None, eos_id: int = ByteTokenizer.eos_id) -> None:
    """Raise (OSError/ValueError) what load_tokens / load_documents would trip over, before any
    model is built. Ids are checked where they are known without the model's tokenizer: a .pt
    corpus, or text under the byte tokenizer (ids < 259); the tokenizer's ids at load time."""
    if data is not None and data.endswith(".pt"):
        tokens = read_token_file(data)
        check_ids(int(tokens.max()), vocab_size, f"--data {data!r}")
        if pack:
            split_documents(tokens, eos_id, data)
        else:
            check_length(tokens.numel(), seq_len)
        return
    if model_dir is not None:
        check_tokenizer(model_dir)
    text = read_text(data)
    if model_dir is None and not pack:
        check_length(len(text.encode("utf-8")), seq_len)


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    check_tokenizer(model_dir)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_tokens(data: Optional[str] = None, model_dir: Optional[str] = None) -> torch.Tensor:
    """The whole corpus as one 1-D int64 tensor.

    data: None (pydoc_data.topics), a UTF-8 text file, or a .pt file holding a 1-D integer tensor
    of token ids. model_dir: a local HF checkpoint whose tokenizer is used for text (else bytes).
    """
    if data is not None and data.endswith(".pt"):
        return read_token_file(data)
    text = read_text(data)
    if model_dir is not None:
        ids = _tokenizer(model_dir)(text, add_special_tokens=False)["input_ids"]
    else:
        ids = ByteTokenizer().encode(text)
    return torch.tensor(ids, dtype=torch.long)


def get_batch(tokens: torch.Tensor, *, step: int, dp_rank: int, batch_size: int, seq_len: int,
              seed: int, bos_id: int = ByteTokenizer.bos_id) -> torch.Tensor:
    """[batch_size, seq_len + 1] windows of `tokens`, each starting with bos, at random offsets
    drawn from (seed, step, dp_rank). Shift for labels on the full sequence, before sharding."""
    need = seq_len  # bos + seq_len tokens of text
    check_length(tokens.numel(), seq_len)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + dp_rank * 104_729)
    starts = torch.randint(0, tokens.numel() - need, (batch_size,), generator=g)
    rows = [torch.cat([torch.tensor([bos_id]), tokens[s:s + need]]) for s in starts.tolist()]
    return torch.stack(rows)


def load_documents(data: Optional[str] = None, model_dir: Optional[str] = None,
                   eos_id: int = ByteTokenizer.eos_id) -> list:
    """The corpus as a list of documents (1-D int64 tensors, none empty), for --pack.

    Text (the default corpus or a UTF-8 file) is split at blank lines ("\\n\\n"), each piece
    tokenized on its own; a .pt token tensor is split at eos_id tokens (dropped)."""
    if data is not None and data.endswith(".pt"):
        return split_documents(read_token_file(data), eos_id, data)
    pieces = [p for p in read_text(data).split("\n\n") if p.strip()]
    if model_dir is not None:
        docs = [torch.tensor(ids, dtype=torch.long)
                for ids in _tokenizer(model_dir)(pieces, add_special_tokens=False)["input_ids"]]
    else:
        enc = ByteTokenizer().encode
        docs = [torch.tensor(enc(p), dtype=torch.long) for p in pieces]
    return _non_empty(docs, data)


def split_documents(tokens: torch.Tensor, eos_id: int, data: Optional[str]) -> list:
    """A .pt corpus cut at its eos_id tokens (dropped) into non-empty documents."""
    cuts = (tokens == eos_id).nonzero()[:, 0].tolist()
    bounds = zip([-1] + cuts, cuts + [tokens.numel()])
    return _non_empty([tokens[a + 1:b] for a, b in bounds], data)


def _non_empty(docs: list, data: Optional[str]) -> list:
    docs = [d for d in docs if d.numel()]
    if not docs:
        raise ValueError(f"--pack found no documents in --data {data!r}")
    return docs


def get_packed_batch(docs: list, *, step: int, dp_rank: int, seq_len: int, seed: int,
                     bos_id: int = ByteTokenizer.bos_id, pad_id: int = ByteTokenizer.pad_id):
    """One packed row for --pack: (inputs [1, seq_len], labels [1, seq_len], cu_seqlens list).

    Documents, each as bos + its tokens, are taken in corpus order from a start drawn from (seed,
    step, dp_rank) and packed greedily while they fit whole (a first document longer than the
    row is cut to it). cu_seqlens = [0, e1, ..., T_docs] are the row's GLOBAL boundaries. Labels
    are next tokens WITHIN a document: each document's last token predicts nothing (-100), so no
    label crosses a boundary; the tail after T_docs is pad_id with labels -100, in no document."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + dp_rank * 104_729)
    i = int(torch.randint(0, len(docs), (1,), generator=g))
    inp = torch.full((seq_len,), pad_id, dtype=torch.long)
    lab = torch.full((seq_len,), -100, dtype=torch.long)
    cu = [0]
    for _ in range(len(docs)):
        doc = torch.cat([torch.tensor([bos_id]), docs[i]])[:seq_len]
        end = cu[-1] + doc.numel()
        if end > seq_len:
            break
        inp[cu[-1]:end] = doc
        lab[cu[-1]:end - 1] = doc[1:]
        cu.append(end)
        i = (i + 1) % len(docs)
    return inp[None], lab[None], cu
