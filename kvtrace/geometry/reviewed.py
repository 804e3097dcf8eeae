"""The causal-LM model types whose layer plan kvtrace.geometry was checked against transformers' own
cache construction (tests/geometry/test_geometry_sweep.py, run under the oldest and the newest
supported transformers): each either matches or is refused with a reason. A model type outside this
set (added by a newer transformers) still gets the generic rules, but `calc` says its geometry is
unverified, and the sweep reports a disagreement on it as expected-to-fail rather than red: a
release that adds a model never breaks kvtrace's suite by itself. Extend the set when the sweep
passes for a new release.
"""

from __future__ import annotations

REVIEWED_MODEL_TYPES: frozenset[str] = frozenset({
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "axk2", "bailing_hybrid", "bamba",
    "bart", "beam", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "biogpt", "bitnet",
    "blenderbot", "blenderbot-small", "bloom", "camembert", "codegen", "cohere", "cohere2", "cohere2_moe",
    "cohere_compass_text", "cpmant", "ctrl", "cwm", "data2vec-text", "dbrx", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "diffllama", "doge", "dory", "dots1", "dots3_note", "dots3_note_text", "electra",
    "emu3", "ernie", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "falcon", "falcon_h1",
    "falcon_mamba", "flex_olmo", "flint", "fuyu", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n",
    "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_assistant",
    "gemma4_unified_text", "git", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "got_ocr2",
    "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gpt_neox_japanese", "gpt_oss", "gptj",
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
    "helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hy_v4", "hyperclovax",
    "inkling2_loop_text", "inkling2_text", "inkling_text", "internlm3", "iquestcoder", "jais2", "jamba",
    "jetmoe", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "llama",
    "llama4", "llama4_text", "longcat_flash", "mamba", "mamba2", "marian", "mbart", "megatron-bert",
    "mellum", "mimo_v2_flash", "minicpm3", "minimax", "minimax_m2", "minimax_m3_vl_text", "ministral",
    "ministral3", "mistral", "mixtral", "mllama", "modernbert-decoder", "moshi", "moss_transcribe_diarize",
    "mpt", "musicgen", "musicgen_melody", "mvp", "nanochat", "nemotron", "nemotron_h", "olmo", "olmo2",
    "olmo3", "olmo_hybrid", "olmoe", "openai-gpt", "opt", "pegasus", "persimmon", "phi", "phi3",
    "phi4_multimodal", "phimoe", "plbart", "prophetnet", "qwen2", "qwen2_moe", "qwen3", "qwen3_5",
    "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen4_exp",
    "qwen4_exp_text", "recurrent_gemma", "reformer", "rembert", "roberta", "roberta-prelayernorm",
    "roc_bert", "roformer", "rwkv", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open",
    "stablelm", "starcoder2", "trocr", "vaultgemma", "whisper", "xglm", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xlnet", "xlstm", "xmod", "youtu", "zamba", "zamba2", "zaya",
})


def is_reviewed(model_type: str) -> bool:
    return model_type in REVIEWED_MODEL_TYPES
