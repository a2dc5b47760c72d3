"""Generate the model presets in ``perfmodel/data/*.json``.

Run ``python -m aps_perfmodel._generate_presets`` to rebuild them. Each preset lists
every parameter tensor in definition order (the order ``module.parameters()``
yields, which is what DDP buckets) with its element count and the forward
FLOPs per sample attributed to it, plus the source of the architecture.

- resnet50 and vit-b16 are built here with plain ``torch.nn`` on the meta
  device, mirroring torchvision's module structure (so the parameter order
  matches), and their FLOPs are counted with forward hooks.
- bert-large, gpt2-xl and llama-7b are generated from the published
  hyperparameters (the Hugging Face configs of the released checkpoints),
  in the Hugging Face modules' parameter order. Building them would need tens
  of GB, so their counts are computed analytically.

FLOPs are 2 per multiply-accumulate of convolutions and matmuls, including
the attention score/value products (attributed to the attention's input
projection); normalisation and activations are left out (under 1%).

Example:
    >>> spec = _resnet50()
    >>> spec["total_params"]
    25557032
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

DATA_DIR = Path(__file__).with_name("data")

Tensors = list[tuple[str, int, float]]


class _Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck (stride on the 3x3 conv)."""

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU()
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4)
            )
            if downsample
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = self.downsample(x) if self.downsample is not None else x
        return self.relu(out + identity)


class _ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = 64
        for i, (planes, blocks, stride) in enumerate(
            [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], start=1
        ):
            layers = []
            for b in range(blocks):
                s = stride if b == 0 else 1
                layers.append(_Bottleneck(inplanes, planes, s, downsample=b == 0))
                inplanes = planes * 4
            setattr(self, f"layer{i}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class _EncoderBlock(nn.Module):
    """torchvision's ViT encoder block with the attention written out (to count its FLOPs)."""

    def __init__(self, dim: int, heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = nn.Module()
        self.self_attention.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.self_attention.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.self_attention.out_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = nn.functional.linear(
            self.ln_1(x), self.self_attention.in_proj_weight, self.self_attention.in_proj_bias
        )
        q, k, v = qkv.view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.self_attention.out_proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln_2(x))


class _ViTB16(nn.Module):
    def __init__(self, image: int = 224, patch: int = 16, dim: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, dim, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        seq = (image // patch) ** 2 + 1
        self.encoder = nn.Module()
        self.encoder.pos_embedding = nn.Parameter(torch.empty(1, seq, dim))
        self.encoder.layers = nn.Sequential(*[_EncoderBlock(dim, 12, 3072) for _ in range(layers)])
        self.encoder.ln = nn.LayerNorm(dim)
        self.heads = nn.Sequential()
        self.heads.add_module("head", nn.Linear(dim, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.encoder.ln(self.encoder.layers(x + self.encoder.pos_embedding))
        return self.heads(x[:, 0])


def _count_with_hooks(model: nn.Module, example: torch.Tensor) -> Tensors:
    """Per-tensor (name, numel, forward FLOPs per sample) by hooking conv/linear modules."""
    flops: dict[str, float] = {}
    names = {id(p): n for n, p in model.named_parameters()}

    def conv_hook(mod: nn.Conv2d, _inp: Any, out: torch.Tensor) -> None:
        macs = out[0].numel() * mod.in_channels // mod.groups * math.prod(mod.kernel_size)
        flops[names[id(mod.weight)]] = flops.get(names[id(mod.weight)], 0.0) + 2.0 * macs

    def linear_hook(mod: nn.Linear, _inp: Any, out: torch.Tensor) -> None:
        macs = out[0].numel() * mod.in_features
        flops[names[id(mod.weight)]] = flops.get(names[id(mod.weight)], 0.0) + 2.0 * macs

    def block_hook(mod: _EncoderBlock, inp: Any, _out: torch.Tensor) -> None:
        _, s, d = inp[0].shape
        key = names[id(mod.self_attention.in_proj_weight)]
        # The in-projection (3 d^2 per token) plus QK^T and AV (2 s^2 d MACs).
        flops[key] = flops.get(key, 0.0) + 2.0 * (s * 3 * d * d + 2 * s * s * d)

    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            mod.register_forward_hook(conv_hook)
        elif isinstance(mod, nn.Linear):
            mod.register_forward_hook(linear_hook)
        elif isinstance(mod, _EncoderBlock):
            mod.register_forward_hook(block_hook)
    with torch.no_grad():
        model(example)
    return [(n, p.numel(), flops.get(n, 0.0)) for n, p in model.named_parameters()]


def _pack(
    name: str, tensors: Tensors, source: str, config: dict[str, Any], published: float
) -> dict[str, Any]:
    total = sum(t[1] for t in tensors)
    return {
        "name": name,
        "source": source,
        "config": config,
        "published_total_params": published,
        "total_params": total,
        "forward_flops_per_sample": sum(t[2] for t in tensors),
        "tensors": [[n, c, f] for n, c, f in tensors],
    }


def _resnet50() -> dict[str, Any]:
    with torch.device("meta"):
        model = _ResNet50()
        tensors = _count_with_hooks(model, torch.empty(1, 3, 224, 224))
    return _pack(
        "resnet50",
        tensors,
        "He et al., Deep Residual Learning (CVPR 2016), ResNet-50 v1.5 as in torchvision "
        "resnet50 (stride on the 3x3 conv); built with torch.nn in perfmodel/_generate_presets.py",
        {"input": [3, 224, 224], "num_classes": 1000},
        25.557032e6,
    )


def _vit_b16() -> dict[str, Any]:
    with torch.device("meta"):
        model = _ViTB16()
        tensors = _count_with_hooks(model, torch.empty(1, 3, 224, 224))
    return _pack(
        "vit-b16",
        tensors,
        "Dosovitskiy et al., An Image is Worth 16x16 Words (ICLR 2021), ViT-B/16 as in "
        "torchvision vit_b_16; built with torch.nn in perfmodel/_generate_presets.py",
        {"image": 224, "patch": 16, "hidden": 768, "layers": 12, "heads": 12, "mlp": 3072},
        86.567656e6,
    )


def _linear(prefix: str, d_in: int, d_out: int, tokens: int, bias: bool) -> Tensors:
    out = [(f"{prefix}.weight", d_in * d_out, 2.0 * d_in * d_out * tokens)]
    if bias:
        out.append((f"{prefix}.bias", d_out, 0.0))
    return out


def _norm(prefix: str, d: int, bias: bool = True) -> Tensors:
    return [(f"{prefix}.weight", d, 0.0)] + ([(f"{prefix}.bias", d, 0.0)] if bias else [])


def _attention_flops(s: int, d: int) -> float:
    return 2.0 * 2 * s * s * d  # QK^T and AV, 2 FLOPs per MAC


def _bert_large() -> dict[str, Any]:
    cfg = {
        "vocab": 30522,
        "hidden": 1024,
        "layers": 24,
        "heads": 16,
        "intermediate": 4096,
        "max_position": 512,
        "type_vocab": 2,
        "seq_len": 512,
    }
    d, s = cfg["hidden"], cfg["seq_len"]
    t: Tensors = [
        ("embeddings.word_embeddings.weight", cfg["vocab"] * d, 0.0),
        ("embeddings.position_embeddings.weight", cfg["max_position"] * d, 0.0),
        ("embeddings.token_type_embeddings.weight", cfg["type_vocab"] * d, 0.0),
        *_norm("embeddings.LayerNorm", d),
    ]
    for i in range(cfg["layers"]):
        p = f"encoder.layer.{i}"
        q = _linear(f"{p}.attention.self.query", d, d, s, True)
        q[0] = (q[0][0], q[0][1], q[0][2] + _attention_flops(s, d))
        t += q + _linear(f"{p}.attention.self.key", d, d, s, True)
        t += _linear(f"{p}.attention.self.value", d, d, s, True)
        t += _linear(f"{p}.attention.output.dense", d, d, s, True)
        t += _norm(f"{p}.attention.output.LayerNorm", d)
        t += _linear(f"{p}.intermediate.dense", d, cfg["intermediate"], s, True)
        t += _linear(f"{p}.output.dense", cfg["intermediate"], d, s, True)
        t += _norm(f"{p}.output.LayerNorm", d)
    t += _linear("pooler.dense", d, d, 1, True)
    return _pack(
        "bert-large",
        t,
        "Devlin et al., BERT (NAACL 2019), BERT-Large; hyperparameters of the released "
        "bert-large-uncased config (Hugging Face BertModel with pooler, no MLM head); "
        "generated analytically in perfmodel/_generate_presets.py",
        cfg,
        340e6,
    )


def _gpt2_xl() -> dict[str, Any]:
    cfg = {
        "vocab": 50257,
        "hidden": 1600,
        "layers": 48,
        "heads": 25,
        "n_positions": 1024,
        "seq_len": 1024,
        "tied_lm_head": True,
    }
    d, s = cfg["hidden"], cfg["seq_len"]
    # The tied output projection runs on the token embedding matrix.
    t: Tensors = [
        ("wte.weight", cfg["vocab"] * d, 2.0 * cfg["vocab"] * d * s),
        ("wpe.weight", cfg["n_positions"] * d, 0.0),
    ]
    for i in range(cfg["layers"]):
        p = f"h.{i}"
        t += _norm(f"{p}.ln_1", d)
        qkv = _linear(f"{p}.attn.c_attn", d, 3 * d, s, True)
        qkv[0] = (qkv[0][0], qkv[0][1], qkv[0][2] + _attention_flops(s, d))
        t += qkv + _linear(f"{p}.attn.c_proj", d, d, s, True)
        t += _norm(f"{p}.ln_2", d)
        t += _linear(f"{p}.mlp.c_fc", d, 4 * d, s, True)
        t += _linear(f"{p}.mlp.c_proj", 4 * d, d, s, True)
    t += _norm("ln_f", d)
    return _pack(
        "gpt2-xl",
        t,
        "Radford et al., Language Models are Unsupervised Multitask Learners (2019), GPT-2 XL; "
        "hyperparameters of the released gpt2-xl config (Hugging Face GPT2Model order, "
        "lm_head tied to wte); generated analytically in perfmodel/_generate_presets.py",
        cfg,
        1.542e9,  # "1542M" in the paper's Table 2
    )


def _llama_7b() -> dict[str, Any]:
    cfg = {
        "vocab": 32000,
        "hidden": 4096,
        "layers": 32,
        "heads": 32,
        "intermediate": 11008,
        "seq_len": 2048,
        "tied_lm_head": False,
    }
    d, s, f = cfg["hidden"], cfg["seq_len"], cfg["intermediate"]
    t: Tensors = [("model.embed_tokens.weight", cfg["vocab"] * d, 0.0)]
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}"
        q = _linear(f"{p}.self_attn.q_proj", d, d, s, False)
        q[0] = (q[0][0], q[0][1], q[0][2] + _attention_flops(s, d))
        t += q
        for proj in ("k_proj", "v_proj", "o_proj"):
            t += _linear(f"{p}.self_attn.{proj}", d, d, s, False)
        t += _linear(f"{p}.mlp.gate_proj", d, f, s, False)
        t += _linear(f"{p}.mlp.up_proj", d, f, s, False)
        t += _linear(f"{p}.mlp.down_proj", f, d, s, False)
        t += _norm(f"{p}.input_layernorm", d, bias=False)
        t += _norm(f"{p}.post_attention_layernorm", d, bias=False)
    t += _norm("model.norm", d, bias=False)
    t += _linear("lm_head", d, cfg["vocab"], s, False)
    return _pack(
        "llama-7b",
        t,
        "Touvron et al., LLaMA: Open and Efficient Foundation Language Models (2023), 7B; "
        "hyperparameters of the released config (Hugging Face LlamaForCausalLM order, "
        "untied lm_head, RMSNorm without bias); generated analytically in "
        "perfmodel/_generate_presets.py",
        cfg,
        6.7e9,
    )


GENERATORS = {
    "resnet50": _resnet50,
    "vit-b16": _vit_b16,
    "bert-large": _bert_large,
    "gpt2-xl": _gpt2_xl,
    "llama-7b": _llama_7b,
}


def main() -> None:
    """Write every preset to ``perfmodel/data/<name>.json`` and print the totals."""
    DATA_DIR.mkdir(exist_ok=True)
    for name, gen in GENERATORS.items():
        spec = gen()
        (DATA_DIR / f"{name}.json").write_text(json.dumps(spec, indent=None) + "\n")
        print(
            f"{name:12s} {spec['total_params']:>14,d} params "
            f"(published {spec['published_total_params']:.4g}), "
            f"{spec['forward_flops_per_sample'] / 1e9:9.2f} GFLOP fwd/sample, "
            f"{len(spec['tensors'])} tensors"
        )


if __name__ == "__main__":
    main()
