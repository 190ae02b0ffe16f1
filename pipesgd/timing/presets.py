"""Published numbers the scale map (``python -m pipesgd.timing map``) starts from: model sizes and
layer shapes, per-GPU step times, link rates and latencies. Every number carries the public source
it was read from; docs/scale-map.md tabulates them. A cell with no public source is absent, not
estimated: :func:`compute_preset` says which cells exist.

Layer shapes are built from each architecture's published hyperparameters (the source string says
which), in ``model.parameters()`` order, and their total is checked against the published count
by the tests. Pure data: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ModelPreset:
    """A model's gradient: its parameter tensors' shapes (fp32 on the wire, 4 bytes a value)."""

    name: str
    shapes: tuple[Shape, ...]
    published_params: int
    source: str
    panel: bool = True  # drawn on docs/scale-map.md's GPU-cluster heatmaps (a CPU-sized model is not)

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class ComputePreset:
    """One GPU's forward + backward + optimizer step on a stated per-GPU batch, from a published
    single-GPU training throughput: ``step_ms = 1000 · batch / throughput``."""

    model: str
    gpu: str
    batch: int
    precision: str
    throughput: float
    unit: str
    source: str

    @property
    def step_ms(self) -> float:
        return 1e3 * self.batch / self.throughput


@dataclass(frozen=True)
class LinkPreset:
    """A link as the timing model sees it: rate per direction per GPU, and α per message."""

    name: str
    bits_per_second: float
    latency_s: float
    source: str
    latency_source: str


def _linear(out: int, inp: int, bias: bool = True) -> list[Shape]:
    return [(out, inp)] + ([(out,)] if bias else [])


def _norm(width: int) -> list[Shape]:
    return [(width,), (width,)]


def resnet50_shapes(classes: int = 1000) -> tuple[Shape, ...]:
    """torchvision ``resnet50`` (v1.5: stride in the 3x3 conv; the same shapes as v1)."""
    shapes: list[Shape] = [(64, 3, 7, 7), *_norm(64)]
    inp = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, inp, 1, 1), *_norm(width), (width, width, 3, 3), *_norm(width),
                       (4 * width, width, 1, 1), *_norm(4 * width)]
            if b == 0:
                shapes += [(4 * width, inp, 1, 1), *_norm(4 * width)]
            inp = 4 * width
    return tuple(shapes + _linear(classes, 2048))


def bert_shapes(layers: int, hidden: int, ffn: int, vocab: int, positions: int,
                token_types: int = 2) -> tuple[Shape, ...]:
    """Hugging Face ``BertModel`` (embeddings, encoder, pooler)."""
    shapes: list[Shape] = [(vocab, hidden), (positions, hidden), (token_types, hidden), *_norm(hidden)]
    for _ in range(layers):
        for _qkv_out in range(4):  # query, key, value, attention output
            shapes += _linear(hidden, hidden)
        shapes += _norm(hidden) + _linear(ffn, hidden) + _linear(hidden, ffn) + _norm(hidden)
    return tuple(shapes + _linear(hidden, hidden))


def gpt2_shapes(layers: int, hidden: int, vocab: int, positions: int) -> tuple[Shape, ...]:
    """Hugging Face ``GPT2Model`` (Conv1D weights are (in, out); the LM head is tied to wte)."""
    shapes: list[Shape] = [(vocab, hidden), (positions, hidden)]
    for _ in range(layers):
        shapes += _norm(hidden) + [(hidden, 3 * hidden), (3 * hidden,), (hidden, hidden), (hidden,)]
        shapes += _norm(hidden) + [(hidden, 4 * hidden), (4 * hidden,), (4 * hidden, hidden), (hidden,)]
    return tuple(shapes + _norm(hidden))


def vit_shapes(layers: int, hidden: int, mlp: int, patch: int, image: int, classes: int) -> tuple[Shape, ...]:
    """torchvision ``VisionTransformer`` (class token, patch conv, position embedding, encoder, head)."""
    tokens = (image // patch) ** 2 + 1
    shapes: list[Shape] = [(1, 1, hidden), (hidden, 3, patch, patch), (hidden,), (1, tokens, hidden)]
    for _ in range(layers):
        shapes += _norm(hidden) + [(3 * hidden, hidden), (3 * hidden,)] + _linear(hidden, hidden)
        shapes += _norm(hidden) + _linear(mlp, hidden) + _linear(hidden, mlp)
    return tuple(shapes + _norm(hidden) + _linear(classes, hidden))


def pipesgd_gpt_shapes(layers: int, width: int, vocab: int, positions: int) -> tuple[Shape, ...]:
    """``pipesgd.models.GPT`` (conf/model/gpt.yaml): token and position embeddings, pre-norm blocks
    (two LayerNorms, fused qkv, projection, 4x MLP), a final LayerNorm; the head is tied to the
    token embedding (one parameter, reduced once)."""
    shapes: list[Shape] = [(vocab, width), (positions, width)]
    for _ in range(layers):
        shapes += _norm(width) + _norm(width) + _linear(3 * width, width) + _linear(width, width)
        shapes += _linear(4 * width, width) + _linear(width, 4 * width)
    return tuple(shapes + _norm(width))


MODELS: dict[str, ModelPreset] = {m.name: m for m in (
    ModelPreset(
        "resnet50", resnet50_shapes(), 25_557_032,
        "He et al., Deep Residual Learning for Image Recognition, CVPR 2016, Table 1 (50-layer: "
        "bottleneck blocks [3, 4, 6, 3]); count 25,557,032 from the torchvision model table, "
        "https://pytorch.org/vision/stable/models/generated/torchvision.models.resnet50.html"),
    ModelPreset(
        "bert-large", bert_shapes(24, 1024, 4096, 30522, 512), 340_000_000,
        "Devlin et al., BERT, NAACL 2019, section 3: BERT-LARGE L=24, H=1024, A=16, 340M parameters "
        "(feed-forward 4H); vocabulary 30,522 and 512 positions from Google's released "
        "bert_config.json (uncased_L-24_H-1024_A-16), https://github.com/google-research/bert"),
    ModelPreset(
        "gpt2-xl", gpt2_shapes(48, 1600, 50257, 1024), 1_542_000_000,
        "Radford et al., Language Models are Unsupervised Multitask Learners, 2019, Table 2: "
        "48 layers, d_model 1600, 1542M parameters; vocabulary 50,257 and context 1024 from "
        "section 2.3, https://cdn.openai.com/better-language-models/"
        "language_models_are_unsupervised_multitask_learners.pdf"),
    ModelPreset(
        "vit-b16", vit_shapes(12, 768, 3072, 16, 224, 1000), 86_000_000,
        "Dosovitskiy et al., An Image is Worth 16x16 Words, ICLR 2021, Table 1: ViT-Base 12 layers, "
        "hidden 768, MLP 3072, 86M parameters; patch 16 at 224 px, 1000 classes (ImageNet fine-tuning)"),
    ModelPreset(
        "gpt-shakespeare", pipesgd_gpt_shapes(6, 128, 256, 128), 1_239_040,
        "this project's +experiment=gpt_shakespeare model (pipesgd.models.GPT, conf/model/gpt.yaml: 6 "
        "layers, width 128, 4 heads, byte vocabulary 256, 128 positions, tied head; a GPT-2-style "
        "pre-norm decoder after Radford et al., 2019); 1,239,040 parameters counted by building it",
        panel=False),
)}
"""The four model presets of the scale map (ViT-B as ViT-B/16)."""

_DLE_RN50 = ("NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "
             "'Training performance results' (pytorch-21.03 NGC container), "
             "https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/resnet50v1.5"
             "#training-performance-results; per-GPU batch 256 for AMP on DGX1V and DGXA100 from "
             "PyTorch/Classification/ConvNets/configs.yml")

_DLE_BERT = ("NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md, 'Training performance "
             "results', pre-training phase 1 (sequence length 128, LAMB), pytorch:21.11-py3 NGC container, "
             "https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/LanguageModeling/BERT"
             "#training-performance-results")

COMPUTE: tuple[ComputePreset, ...] = (
    ComputePreset("resnet50", "v100", 256, "mixed (AMP)", 1200, "img/s",
                  _DLE_RN50 + ": NVIDIA DGX-1 16GB (8x V100 16GB), 1 GPU, mixed precision 1200 img/s"),
    ComputePreset("resnet50", "a100", 256, "mixed (AMP)", 2470, "img/s",
                  _DLE_RN50 + ": NVIDIA DGX A100 (8x A100 80GB), 1 GPU, mixed precision 2470 img/s"),
    ComputePreset("bert-large", "v100", 64, "mixed (AMP)", 224, "sequences/s",
                  _DLE_BERT + ": NVIDIA DGX-1 (8x V100 32G), 1 GPU, mixed precision 224 sequences/s; "
                  "micro-batch 64 = the table's 4096 per GPU over its 64 accumulation steps"),
    ComputePreset("bert-large", "a100", 256, "mixed (AMP)", 580, "sequences/s",
                  _DLE_BERT + ": NVIDIA DGX A100 (8x A100 80GB), 1 GPU, mixed precision 580 sequences/s, "
                  "batch 256 per GPU (accumulated to 8192 over 32 steps)"),
)
"""Published single-GPU training throughput, one row per (model, GPU) that has one; the step is one
micro-batch (the published BERT runs accumulate 32-64 of them per gradient exchange, which the map
does not assume). No cited single-GPU number was found for H100 (any model), nor for GPT-2-XL or
ViT-B on any GPU (docs/scale-map.md lists what was searched); those cells are absent."""

GPUS = ("v100", "a100", "h100")

_NCCL_NET = ("NCCL's own latency model, src/graph/tuning.cc (https://github.com/NVIDIA/nccl), "
             "hwLat[NET][Ring][Simple] = 14 us per ring step; the same for every NIC speed")
_NCCL_NVLINK = "NCCL src/graph/tuning.cc, hwLat[NVLINK][Ring][Simple] = 3.4 us per ring step"

LINKS: dict[str, LinkPreset] = {link.name: link for link in (
    LinkPreset("10gbe", 10e9, 14e-6, "IEEE 802.3ae 10 Gbit/s Ethernet, line rate per direction", _NCCL_NET),
    LinkPreset("25gbe", 25e9, 14e-6, "IEEE 802.3by 25 Gbit/s Ethernet, line rate per direction", _NCCL_NET),
    LinkPreset("100g", 100e9, 14e-6, "IEEE 802.3ba 100 Gbit/s Ethernet or InfiniBand EDR 4x (100 Gbit/s), "
               "line rate per direction", _NCCL_NET),
    LinkPreset("400g", 400e9, 14e-6, "IEEE 802.3bs 400 Gbit/s Ethernet or InfiniBand NDR 4x (400 Gbit/s), "
               "line rate per direction", _NCCL_NET),
    LinkPreset("nvlink-v100", 150e9 * 8, 3.4e-6, "NVLink 2 on V100 SXM2: 300 GB/s total per GPU "
               "(https://www.nvidia.com/en-us/data-center/v100/), 150 GB/s per direction", _NCCL_NVLINK),
    LinkPreset("nvlink-a100", 300e9 * 8, 3.4e-6, "NVLink 3 on A100 SXM4: 600 GB/s total per GPU "
               "(https://www.nvidia.com/en-us/data-center/a100/), 300 GB/s per direction", _NCCL_NVLINK),
    LinkPreset("nvlink-h100", 450e9 * 8, 3.4e-6, "NVLink 4 on H100 SXM5: 900 GB/s total per GPU "
               "(https://www.nvidia.com/en-us/data-center/h100/), 450 GB/s per direction", _NCCL_NVLINK),
)}
"""Inter-node links (one NIC per GPU, rail-optimised, as DGX nodes ship) and the NVLink within a node."""

INTER_NODE_LINKS = ("10gbe", "25gbe", "100g", "400g")

BACKWARD_SHARE = 2 / 3
BACKWARD_SHARE_SOURCE = ("backward = 2x forward in FLOPs (training ~ 6N FLOPs per token: 2N forward, 4N "
                         "backward), Kaplan et al., Scaling Laws for Neural Language Models, 2020, "
                         "section 2.1; a FLOP share, used as the time share")


def compute_preset(model: str, gpu: str) -> ComputePreset:
    """The published step time of ``model`` on ``gpu``; ValueError naming the cells that exist."""
    if model not in MODELS:
        raise ValueError(f"model preset must be one of {sorted(MODELS)}, got {model!r}")
    if gpu not in GPUS:
        raise ValueError(f"gpu preset must be one of {list(GPUS)}, got {gpu!r}")
    for cell in COMPUTE:
        if (cell.model, cell.gpu) == (model, gpu):
            return cell
    have = [c.gpu for c in COMPUTE if c.model == model]
    raise ValueError(f"no published single-GPU step time for model {model!r} on gpu {gpu!r} "
                     f"(cited cells for {model!r}: {have or 'none'}); pass --compute-ms and --backward-share")


def link_preset(name: str) -> LinkPreset:
    if name not in LINKS:
        raise ValueError(f"link preset must be one of {sorted(LINKS)}, got {name!r}")
    return LINKS[name]
