"""Make the tiny local model the real-vLLM tests serve: a random-weight Llama and a word-level
tokenizer trained here with the `tokenizers` library (no download). Run with the vLLM venv's
Python (its transformers is the one vLLM loads with): ``python vllm_model.py DIR``.

The CPU attention backend needs a head size it has kernels for (16 is refused; 64 works).
Each word of the training text is one token, so a test knows a prompt's token count from its words.
"""

from __future__ import annotations

import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(400)]


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([" ".join(WORDS)] * 2, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.model_max_length = 4096
    cfg = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)


if __name__ == "__main__":
    make(Path(sys.argv[1]))
