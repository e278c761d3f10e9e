"""Write a small random target (mlx-lm format, working BPE tokenizer) and a
random DFlash drafter for it: OUT/target and OUT/drafter. Tests and benchmarks
use it; nothing is downloaded.

    python tests/make_test_pair.py OUT [--hidden H] [--layers N] [--vocab V]
        [--seed S] [--family qwen3|qwen2|llama] [--version 1|2] [--draft-layers N]
        [--block-size B]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import mlx_dflash  # noqa: F401,E402  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_dflash.drafting.drafter import Drafter, save_drafter  # noqa: E402
from mlx_dflash.drafting.drafter_config import DrafterConfig, default_target_layer_ids  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n_chars: int = 400_000):
    """Real text the interpreter ships (deterministic order)."""
    root = sysconfig.get_paths()["stdlib"]
    total = 0
    for f in sorted(glob.glob(os.path.join(root, "*.py"))):
        t = Path(f).read_text(errors="ignore")
        total += len(t)
        yield t
        if total > n_chars:
            return


def write_tokenizer(out: Path, vocab: int) -> dict:
    """Byte-level BPE with exactly `vocab` ids (padded with unused tokens), so
    every id a random model emits decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab:
        tok.add_special_tokens([f"<|unused_{i}|>" for i in range(vocab - n)])
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"vocab {vocab} too small for the byte alphabet and special tokens")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|mask|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return {s: tok.token_to_id(s) for s in SPECIALS}


def target_config(family: str, hidden: int, layers: int, vocab: int, ids: dict) -> dict:
    heads = max(2, hidden // 64)
    cfg = dict(model_type=family, hidden_size=hidden, num_hidden_layers=layers,
               intermediate_size=hidden * 3, num_attention_heads=heads,
               num_key_value_heads=max(1, heads // 2), rms_norm_eps=1e-6, vocab_size=vocab,
               max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False,
               eos_token_id=ids["<|im_end|>"], bos_token_id=None)
    if family == "qwen3":
        cfg["head_dim"] = hidden // heads
    if family == "qwen2":
        cfg["attention_bias"] = True
    cfg["architectures"] = {"qwen3": ["Qwen3ForCausalLM"], "qwen2": ["Qwen2ForCausalLM"],
                            "llama": ["LlamaForCausalLM"]}[family]
    return cfg


def make_target(out: Path, family: str, hidden: int, layers: int, vocab: int, seed: int) -> dict:
    from mlx_lm.utils import _get_classes

    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, vocab)
    cfg = target_config(family, hidden, layers, vocab, ids)
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    # Peaked logits (a trained model's are): random near-ties would make greedy
    # equality tests flaky for reasons unrelated to the decoder.
    # (untied head: a tied random embedding just predicts its own input).
    # Special tokens get zero logits so random generations run to max_tokens;
    # tests that need EOS choose their own.
    w = model.lm_head.weight * 8.0
    special = mx.zeros((vocab, 1)).at[mx.array(list(ids.values()))].add(1.0)
    model.lm_head.weight = w * (1 - special)  # logit 0: far below a peaked row's max
    mx.eval(model.parameters())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"config": cfg, "special_ids": ids}


def make_drafter(out: Path, target_cfg: dict, mask_id: int, *, version: int = 1, layers: int = 1,
                 block_size: int = 16, seed: int = 0, n_taps: int = 0) -> Drafter:
    h = target_cfg["hidden_size"]
    heads = target_cfg["num_attention_heads"]
    n_taps = n_taps or min(3, target_cfg["num_hidden_layers"])
    c = DrafterConfig(
        hidden_size=h, intermediate_size=target_cfg["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=target_cfg["num_key_value_heads"],
        head_dim=h // heads, vocab_size=target_cfg["vocab_size"], mask_token_id=mask_id,
        target_layer_ids=default_target_layer_ids(target_cfg["num_hidden_layers"], n_taps),
        block_size=block_size, num_target_layers=target_cfg["num_hidden_layers"],
        rope_theta=target_cfg["rope_theta"], version=version,
        selector_rank=min(256, h), conv_group_size=16,
    )
    mx.random.seed(seed + 1)
    d = Drafter(c)
    mx.eval(d.parameters())
    save_drafter(d, out, layout="factorised")  # tests adjust the factorised selector in place
    return d


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=["qwen3", "qwen2", "llama"], default="qwen3")
    ap.add_argument("--version", type=int, choices=[1, 2], default=1)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args(argv)
    out = Path(a.out)
    t = make_target(out / "target", a.family, a.hidden, a.layers, a.vocab, a.seed)
    make_drafter(out / "drafter", t["config"], t["special_ids"]["<|mask|>"], version=a.version,
                 layers=a.draft_layers, block_size=a.block_size, seed=a.seed)
    print(f"wrote {out / 'target'} and {out / 'drafter'}")


if __name__ == "__main__":
    main()
