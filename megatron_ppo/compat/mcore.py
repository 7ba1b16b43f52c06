"""megatron-core 0.16.1 through 0.19.x: every difference our code meets, in one place (issue 23).

Supported: ``>=0.16.1,<0.20`` (setup.py); tested in CI: 0.16.1 (the venv) and 0.19.2 (an overlay, docs/models.md).
What differs, as measured on CPU with 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (every symbol we import exists in all of
them; the signatures we call only gained optional parameters):

- 0.18+ imports ``triton`` at ``import megatron.core`` (transformer/moe/paged_stash.py). A dependency, not an API
  difference: setup.py's ``triton`` extra (CUDA torch wheels and GPU containers bring it).
- 0.19+ ``dist_checkpointing.save`` keeps the common (non-tensor) state inside the torch_dist shards, as the
  ShardedObject ``common_state`` (``.metadata`` key ``common_state/shard_0_1``), instead of a ``common.pt`` file
  beside them. 0.19 reads both layouts; 0.16.1-0.18 read only ``common.pt`` (0.16.1 fails on the new layout with
  an ``AttributeError`` deep in dist_checkpointing/strategies/common.py). The piecewise converter (convert/mcore_io.py)
  moves and merges that state; ``check_readable`` turns the one-way read into a clear refusal.
- Checkpoints written by 0.17.1 and 0.18.2 (model + Adam state) load in 0.16.1 with identical weights: the layout
  above is the only known format change, so it is the only one ``check_readable`` refuses.

``MPPO_EXPECT_MCORE=<version>`` makes importing this module fail unless that megatron-core is the one imported:
CI's overlay stage sets it, so a stage that silently runs on another version fails instead of passing.
"""
from __future__ import annotations

import os

from megatron_ppo.errors import UsageError

SUPPORTED = ">=0.16.1,<0.20"  # setup.py's install_requires (tests/unit/test_mcore_compat.py keeps them equal)

LEGACY_COMMON_FILE = "common.pt"  # the common state of a dist checkpoint before 0.19
COMMON_STATE_KEY = "common_state"  # ... and since 0.19: a ShardedObject in the shards ("common_state/shard_0_1")
COMMON_STATE_IN_SHARDS = (0, 19, 0)

# (first version writing it, what changed): a checkpoint from at or after such a version cannot be read before it.
FORMAT_CHANGES = (
    (COMMON_STATE_IN_SHARDS, "the common state of a dist checkpoint is stored in its torch_dist shards, not in "
                             "common.pt"),
)


class McoreVersionError(UsageError):
    """A checkpoint written by a newer megatron-core than this one can read (the message names both versions)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.19.2"``, ``"0.19.2+6e8dfc7"`` (megatron appends the git hash of its directory), ``"0.19.0rc1"``."""
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def version() -> str:
    """The imported megatron-core's release, e.g. ``"0.19.2"`` (without the git hash megatron may append)."""
    from megatron.core import package_info

    return getattr(package_info, "__shortversion__", package_info.__version__.split("+")[0])


def version_tuple() -> tuple[int, int, int]:
    return parse_version(version())


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def check_expected() -> None:
    """Fail unless the imported megatron-core is ``$MPPO_EXPECT_MCORE`` (when set): the CI overlay's guard."""
    want = os.environ.get("MPPO_EXPECT_MCORE")
    if not want:
        return
    import megatron.core

    have = version()
    if parse_version(have) != parse_version(want):
        raise RuntimeError(f"MPPO_EXPECT_MCORE={want}, but megatron-core {have} is imported (from "
                           f"{os.path.dirname(megatron.core.__file__)}): the version overlay did not apply")


# ----------------------------------------------------------------------------------------------------------------
# The common state of a dist checkpoint
# ----------------------------------------------------------------------------------------------------------------
def common_state_in_shards() -> bool:
    """Whether this megatron-core's ``dist_checkpointing.save`` keeps the common state in the shards (0.19+)."""
    return version_tuple() >= COMMON_STATE_IN_SHARDS


def common_state_files() -> tuple[str, ...]:
    """The files a ``dist_checkpointing.save`` writes beside the shards for its common state (none since 0.19)."""
    return () if common_state_in_shards() else (LEGACY_COMMON_FILE,)


def is_common_state_key(key: str) -> bool:
    """Whether a ``.metadata`` key (``common_state/shard_0_1``) is dist_checkpointing's own common state, not ours."""
    return key.split("/shard_")[0] == COMMON_STATE_KEY


def stored_common_state_in_shards(ckpt_dir: str) -> bool:
    """Whether the dist checkpoint at ``ckpt_dir`` has the 0.19+ layout (metadata.json, no common.pt)."""
    return (os.path.isfile(os.path.join(ckpt_dir, "metadata.json"))
            and not os.path.isfile(os.path.join(ckpt_dir, LEGACY_COMMON_FILE)))


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints are one-way: a newer megatron-core reads an older one's, not the other way round
# ----------------------------------------------------------------------------------------------------------------
def check_readable(ckpt_dir: str, written_by: str | None = None) -> None:
    """Refuse, naming both versions, a dist checkpoint this megatron-core cannot read.

    ``written_by``: the megatron-core version stored in our metadata beside the checkpoint (None for checkpoints
    from before it was stored, or from other tools: then the layout on disk decides)."""
    mine = version_tuple()
    if written_by is None:
        if mine < COMMON_STATE_IN_SHARDS and stored_common_state_in_shards(ckpt_dir):
            written_by, writer = f">= {_dotted(COMMON_STATE_IN_SHARDS)}", COMMON_STATE_IN_SHARDS
        else:
            return
    else:
        writer = parse_version(written_by)
    for since, what in FORMAT_CHANGES:
        if writer >= since > mine:
            raise McoreVersionError(
                f"{ckpt_dir} was written by megatron-core {written_by}; this is megatron-core {_dotted(mine)}, "
                f"which cannot read it (since {_dotted(since)} {what}; a checkpoint is readable only by the "
                f"megatron-core that wrote it or a newer one). Install megatron-core>={_dotted(writer)} (supported: "
                f"{SUPPORTED}), or write it again with {_dotted(mine)} (a converted HF model: convert it again)")


if os.environ.get("MPPO_EXPECT_MCORE"):
    check_expected()
