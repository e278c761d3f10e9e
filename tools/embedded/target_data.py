"""The embedded models' training data (tools/embedded/target.py `prepare`): the Python
standard library and GSM8K train as ChatML chat, a byte-level BPE tokenizer trained on
them, and one token stream per source under runs/data/. The last 473 GSM8K train
problems are the dev split, never trained on."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
GSM8K = Path("/work/shared/data/gsm8k/train.jsonl")
N_DEV = 473
DATA = ROOT / "runs" / "data"
VOCAB_SIZE = 4096  # 8192 doubles the (scalar-exp bound) softmax cost on mlx-cpu
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def token_stream(tok, texts) -> np.ndarray:
    """One uint16 token stream: every text encoded, each followed by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.array(ids, dtype=np.uint16)


def gsm8k_rows():
    return [json.loads(l) for l in GSM8K.read_text().splitlines() if l.strip()]


def gsm8k_split():
    rows = gsm8k_rows()
    return rows[:-N_DEV], rows[-N_DEV:]


def write_gsm8k_dev(path: Path = DATA / "gsm8k_dev.jsonl") -> Path:
    """Deterministically (re)write the dev split: the last 473 problems of train.jsonl."""
    _, dev = gsm8k_split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in dev:
            f.write(json.dumps({"messages": [{"role": "user", "content": r["question"]}],
                                "answer": r["answer"]}) + "\n")
    return path


def chat_text(q: str, a: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"


def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    seen, out = set(), []
    for d, dirs, files in os.walk(root):
        rel = Path(d).relative_to(root).parts
        if any(p in skip or p.startswith("config-") for p in rel):
            dirs[:] = []
            continue
        dirs.sort()
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            p = Path(d) / fn
            try:
                txt = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            h = hashlib.sha1(txt.encode()).hexdigest()
            if h in seen or len(txt) < 20:
                continue
            seen.add(h)
            out.append((str(p.relative_to(root)), txt))
    return out


def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": "<|mask|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def cmd_prepare(args):
    DATA.mkdir(parents=True, exist_ok=True)
    write_gsm8k_dev()
    train_rows, _ = gsm8k_split()
    files = stdlib_files()
    rng = np.random.default_rng(0)
    val_idx = set(rng.choice(len(files), size=max(1, len(files) // 100), replace=False).tolist())
    code_train = [t for i, (_, t) in enumerate(files) if i not in val_idx]
    code_val = [t for i, (_, t) in enumerate(files) if i in val_idx]
    chats = [chat_text(r["question"], r["answer"]) for r in train_rows]
    print(f"stdlib files {len(files)} ({sum(len(t) for _, t in files)/1e6:.1f} MB), "
          f"gsm8k train {len(chats)}", flush=True)

    t0 = time.time()
    tok = train_tokenizer(code_train + chats)
    print(f"tokenizer trained in {time.time()-t0:.0f}s, vocab {tok.get_vocab_size()}", flush=True)
    tok_dir = DATA / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    (tok_dir / "special_tokens_map.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"]}, indent=2))

    for s in SPECIALS:
        assert len(tok.encode(s).ids) == 1, s
    sample = "def f(x):\n    return  x\t+ 1\n\n\nclass A:\n        pass\n"
    assert tok.decode(tok.encode(sample).ids, skip_special_tokens=False) == sample
    stream = lambda texts: token_stream(tok, texts)  # noqa: E731

    _, dev = gsm8k_split()
    streams = {
        "code_train": stream(code_train),
        "code_val": stream(code_val),
        "gsm_train": stream(chats),
        "gsm_dev": stream([chat_text(r["question"], r["answer"]) for r in dev]),
    }
    for k, v in streams.items():
        np.save(DATA / f"{k}.npy", v)
    stats = {k: int(v.size) for k, v in streams.items()}
    stats.update(n_stdlib_files=len(files), n_code_val_files=len(code_val),
                 n_gsm_train=len(chats), n_gsm_dev=len(dev),
                 stdlib=sysconfig.get_paths()["stdlib"], python=sys.version.split()[0])
    (DATA / "stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))
