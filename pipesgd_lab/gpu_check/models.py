"""The scale map's model presets as trainable modules for the GPU check's step times, built with
plain torch (a bare GPU machine may have no torchvision or transformers): ResNet-50 (bottleneck
[3, 4, 6, 3]), ViT-B/16, BERT-large and GPT-2-XL with the layer shapes of
:mod:`pipesgd.timing.presets` (the check asserts the parameter counts match the presets'), and the
project's own ResNet-20/18. Each entry: (build, batch maker, published precision recipe)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class _Bottleneck(nn.Module):
    def __init__(self, inp: int, width: int, stride: int):
        super().__init__()
        out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out))
        self.down = None if stride == 1 and inp == out else nn.Sequential(
            nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))


def resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    inp = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(_Bottleneck(inp, width, stride if i == 0 else 1))
            inp = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, classes))


class _Encoder(nn.Module):
    """Pre-norm transformer blocks (GPT-2, ViT) or post-norm (BERT), fused attention."""

    def __init__(self, layers: int, hidden: int, ffn: int, heads: int, norm_first: bool, causal: bool):
        super().__init__()
        block = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=norm_first)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.causal = causal

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device) if self.causal else None
        return self.blocks(x, mask=mask, is_causal=self.causal)


class ViT(nn.Module):
    def __init__(self, layers=12, hidden=768, mlp=3072, heads=12, patch=16, image=224, classes=1000):
        super().__init__()
        self.patch = nn.Conv2d(3, hidden, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, hidden))
        self.encoder = _Encoder(layers, hidden, mlp, heads, norm_first=True, causal=False)
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


class LanguageModel(nn.Module):
    """BERT (post-norm, token types, tied MLM head) or GPT-2 (pre-norm, causal, tied LM head)."""

    def __init__(self, layers: int, hidden: int, ffn: int, heads: int, vocab: int, positions: int, gpt: bool):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.types = None if gpt else nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.encoder = _Encoder(layers, hidden, ffn, heads, norm_first=gpt, causal=gpt)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tokens.weight  # both tie their output layer to the token embedding
        # BertModel's pooler (in the preset's count; its classification use is not timed)
        self.pooler = None if gpt else nn.Linear(hidden, hidden)

    def forward(self, ids):
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        if self.types is not None:
            x = self.norm(x + self.types(torch.zeros_like(ids)))
        x = self.encoder(x)
        return self.head(self.norm(x) if self.types is None else x)


def _images(size: int, classes: int) -> Callable[[int, torch.device], tuple]:
    def make(batch: int, device: torch.device) -> tuple:
        return (torch.randn(batch, 3, size, size, device=device),
                torch.randint(0, classes, (batch,), device=device))
    return make


def _tokens(vocab: int, seq: int) -> Callable[[int, torch.device], tuple]:
    def make(batch: int, device: torch.device) -> tuple:
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        return ids, ids
    return make


def _resnet_cifar(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from pipesgd.models import resnet_cifar
        return getattr(resnet_cifar, name)()
    return build


def _recipe_gpt() -> nn.Module:
    from pipesgd.models import GPT
    return GPT(vocab_size=256, block_size=128, n_layer=6, n_head=4, n_embd=128)  # conf/model/gpt.yaml


# name -> (build, batch maker, batch, AMP as the published recipe, optimizer, preset name in pipesgd.timing)
PRESETS: dict[str, tuple] = {
    "resnet50": (resnet50, _images(224, 1000), 256, True, "sgd", "resnet50"),
    "vit-b16": (ViT, _images(224, 1000), 64, True, "adamw", "vit-b16"),
    "bert-large": (lambda: LanguageModel(24, 1024, 4096, 16, 30522, 512, gpt=False), _tokens(30522, 128), 64,
                   True, "adamw", "bert-large"),
    "gpt2-xl": (lambda: LanguageModel(48, 1600, 6400, 25, 50257, 1024, gpt=True), _tokens(50257, 1024), 4,
                True, "adamw", "gpt2-xl"),
    "resnet20": (_resnet_cifar("resnet20"), _images(32, 10), 128, False, "sgd", None),
    "resnet18": (_resnet_cifar("resnet18"), _images(32, 10), 128, False, "sgd", None),
    "gpt-shakespeare": (_recipe_gpt, _tokens(256, 128), 32, False, "adamw", "gpt-shakespeare"),
}
