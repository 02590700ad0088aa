"""Row-level work on Arrow columns for loaders/arrow.py: the vectorised per-segment scan that
checks every row against the dataset contract and counts its tokens, patches and frames, the
one-line description of the first bad row, the unique-id check, and reading values out of
columns (numeric lists as numpy views). Pure functions of pyarrow arrays and numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from maestro_flow import PipelineError
from maestro_flow.errors import first_line
from maestro_flow.samples import MODALITIES

KNOWN_MODALITIES = MODALITIES

# Audio frames, for `num_frames` when the dataset has no precomputed `num_frames` column: 25 ms
# windows every 10 ms, in whole samples (rounded half up, at least 1), every full window from the
# start, a clip shorter than one window one frame: the audio encoder's default framing
# (stages.audio.num_frames), repeated here so that loaders/ does not import stages/.
AUDIO_WINDOW_S = 0.025
AUDIO_HOP_S = 0.01
# No audio is sampled faster (studio audio is 384 kHz at most); a larger rate is a mistake, and
# framed a clip into windows of millions of samples (found in review: the OOM killer ended it).
MAX_SAMPLE_RATE = 768_000
# Nor slower than 1 kHz (telephone audio is 8 kHz): a rate of 16 is kHz given as Hz, and framed each
# 25 ms window as one sample (found in QA: it trained, on meaningless features).
MIN_SAMPLE_RATE = 1_000

MODALITY_BIT = {name: 1 << i for i, name in enumerate(KNOWN_MODALITIES)}

INT32_END = 1 << 31


def is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def plain_type(t: pa.DataType) -> pa.DataType:
    """The type with nullability and dictionary encoding left out at every depth."""
    if pa.types.is_dictionary(t):
        return plain_type(t.value_type)
    if pa.types.is_large_list(t):
        return pa.large_list(plain_type(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return pa.list_(plain_type(t.value_type), t.list_size)
    if pa.types.is_list(t):
        return pa.list_(plain_type(t.value_type))
    if pa.types.is_map(t):
        return pa.map_(plain_type(t.key_type), plain_type(t.item_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(t.field(i).name, plain_type(t.field(i).type)) for i in range(t.num_fields)])
    return t


def has_dictionary(t: pa.DataType) -> bool:
    """Whether a dictionary-encoded type is in `t`, at any depth."""
    if pa.types.is_dictionary(t):
        return True
    if is_list(t) or pa.types.is_fixed_size_list(t):
        return has_dictionary(t.value_type)
    if pa.types.is_map(t):
        return has_dictionary(t.key_type) or has_dictionary(t.item_type)
    if pa.types.is_struct(t):
        return any(has_dictionary(t.field(i).type) for i in range(t.num_fields))
    return False


def valid_mask(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0 and not pa.types.is_dictionary(arr.type):  # a null may be in the dictionary
        return np.ones(len(arr), dtype=bool)
    return arr.is_valid().to_numpy(zero_copy_only=False)


def as_ints(arr: pa.Array, column: str | None = None) -> np.ndarray:
    """Integer column as int64 numpy, nulls as 0."""
    if arr.null_count:
        arr = pc.fill_null(arr, 0)
    try:
        return arr.cast(pa.int64()).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid as exc:  # an unsigned 64-bit value past int64
        what = f"column {column!r}" if column else "an integer column"
        raise PipelineError(f"data.path: {what} holds a value beyond int64 ({first_line(exc)})") from None


def audio_frames(num_samples: np.ndarray, sample_rate: np.ndarray) -> np.ndarray:
    """Frames of clips of `num_samples` samples at `sample_rate` (see AUDIO_WINDOW_S)."""
    window, hop = (np.maximum(1, np.floor(sample_rate * x + 0.5)).astype(np.int64) for x in (AUDIO_WINDOW_S,
                                                                                                AUDIO_HOP_S))
    return np.maximum(1, 1 + (num_samples - window) // hop)


def parents(arr: pa.Array) -> np.ndarray:
    """Per value of list_flatten(arr) / arr.flatten(): the row it belongs to. Built from the
    lengths, as the flatten is: a null row's offsets may still span values, which the flatten
    leaves out and pc.list_parent_indices would count."""
    return np.repeat(np.arange(len(arr), dtype=np.int64), list_lengths(arr))


def rows_with_null_values(arr: pa.Array) -> np.ndarray:
    """Per row of a list column: whether it holds a null element (a null list is not one)."""
    out = np.zeros(len(arr), dtype=bool)
    values = pc.list_flatten(arr)
    if values.null_count:
        out[parents(arr)[~valid_mask(values)]] = True
    return out


def rows_with_non_finite(arr: pa.Array) -> np.ndarray:
    """Per row of a (nested) list column of floats: whether it holds a NaN or an infinity (found
    in review: one NaN audio sample made the loss of every step after it NaN)."""
    out = np.zeros(len(arr), dtype=bool)
    rows, values = parents(arr), pc.list_flatten(arr)
    while is_list(values.type):
        rows, values = rows[parents(values)], pc.list_flatten(values)
    if pa.types.is_floating(values.type) and len(values):
        finite = pc.fill_null(pc.is_finite(values), True).to_numpy(zero_copy_only=False)
        out[rows[~finite]] = True
    return out


def list_lengths(arr: pa.Array) -> np.ndarray:
    """Per-row list lengths from the offsets alone (nulls as 0); never touches the values."""
    return as_ints(pc.list_value_length(arr))


def payload_lengths(arr: pa.Array) -> np.ndarray:
    """Per row of a payload column: elements of a list, bytes of a binary value (nulls as 0), -1
    for a type without a length (never counted as empty); from the offsets alone (a dictionary-
    encoded column's, from its dictionary's: nothing decoded)."""
    if pa.types.is_dictionary(arr.type):
        per_value = payload_lengths(arr.dictionary)
        if not len(per_value):
            return np.zeros(len(arr), dtype=np.int64)
        return np.where(valid_mask(arr), per_value[as_ints(pc.fill_null(arr.indices, 0))], 0)
    if is_list(arr.type):
        return list_lengths(arr)
    if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type) or is_string(arr.type):
        return as_ints(pc.binary_length(arr))
    return np.full(len(arr), -1, dtype=np.int64)


def token_rows_outside(arr: pa.Array, low: int, end: int, allowed: tuple[int, ...] = ()) -> np.ndarray:
    """Per row of a list<int> column: whether any of its values lies outside [low, end) and is
    not one of `allowed` (null elements are rows_with_null_values' to find)."""
    out = np.zeros(len(arr), dtype=bool)
    values = pc.list_flatten(arr)
    if len(values) == 0:
        return out
    if values.null_count:
        values = pc.fill_null(values, low)
    v = values.to_numpy(zero_copy_only=False)  # its own integer type: a uint64 past int64 compares right
    wrong = (v < low) | (v >= end)
    for ok in allowed:
        wrong &= v != ok
    if wrong.any():
        out[parents(arr)[wrong]] = True
    return out


def token_counts(arr: pa.Array, token: int) -> np.ndarray:
    """Per row of a list<int> column: how many of its values equal `token`."""
    values = pc.list_flatten(arr)
    if len(values) == 0:
        return np.zeros(len(arr), dtype=np.int64)
    hit = (values.to_numpy(zero_copy_only=False) == token) & valid_mask(values)
    return np.bincount(parents(arr)[hit], minlength=len(arr))


def scan_segment(cols: dict[str, pa.Array], n: int, payload: dict[str, str]) -> dict[str, np.ndarray]:
    """Vectorised per-row checks and counts for one segment (no Python loop over rows).
    `payload`: modality -> the column that carries it."""
    id_valid = valid_mask(cols["id"])
    ids = as_ints(cols["id"], "id")
    mods = cols["modalities"]
    mods_valid = valid_mask(mods)
    # Modality names -> bit per row; an unknown or null name marks the row.
    names = mods.flatten()
    codes = pc.index_in(names, value_set=pa.array(KNOWN_MODALITIES, type=names.type))
    codes_np = as_ints(pc.fill_null(codes, -1)) if len(codes) else np.zeros(0, np.int64)
    row_of = parents(mods) if len(codes) else np.zeros(0, np.int64)
    mask = np.zeros(n, dtype=np.int64)
    known = codes_np >= 0
    np.bitwise_or.at(mask, row_of[known], np.left_shift(1, codes_np[known]))
    unknown = np.zeros(n, dtype=bool)
    unknown[row_of[~known]] = True
    tokens_valid = valid_mask(cols["tokens"])
    num_tokens = list_lengths(cols["tokens"])
    # Token ids are read as int32: a wider column must fit, and no id is negative.
    tokens_out = token_rows_outside(cols["tokens"], 0, INT32_END) | rows_with_null_values(cols["tokens"])
    bad = ~id_valid | ~mods_valid | (mask == 0) | unknown | ~tokens_valid | (num_tokens == 0) | tokens_out
    for modality in ("image", "audio"):
        declared = (mask & MODALITY_BIT[modality]) != 0
        column = payload[modality]
        present = valid_mask(cols[column]) if column in cols else np.zeros(n, dtype=bool)
        bad |= declared != present
        if column in cols:
            # An empty clip trained as one silent frame, an empty image failed at run time (review)
            bad |= present & (payload_lengths(cols[column]) == 0)
        if column in cols and (is_list(cols[column].type) or pa.types.is_fixed_size_list(cols[column].type)):
            bad |= rows_with_null_values(cols[column])  # a null audio sample would be read as NaN
            bad |= rows_with_non_finite(cols[column])
    zeros = np.zeros(n, dtype=np.int64)
    has = {m: (mask & MODALITY_BIT[m]) != 0 for m in ("image", "audio")}
    # Precomputed counts: given (not null, not negative) on every row with the modality, and 0 on
    # the others, whatever the column holds there.
    imaged = has["image"] & ~bad  # a bad row is named for what makes it bad first
    if "num_patches" not in cols and imaged.any():  # found in review: taken as 0 patches, silently
        first = int(np.argmax(imaged))  # local to this segment: the id names it
        raise PipelineError(f"data.path: sample id {int(ids[first])} has an image, and the data has no "
                            "'num_patches' column: rows with an image need their patch count there (int32, "
                            "loaders.dali.num_patches) for the planner's costs and the length checks")
    counts = {}
    for column, modality in (("num_patches", "image"), ("num_frames", "audio")):
        if column in cols:
            values = as_ints(cols[column], column)
            bad |= has[modality] & (~valid_mask(cols[column]) | (values < LEAST[column][0]))
            counts[column] = np.where(has[modality], values, 0)
    num_frames = counts.get("num_frames", zeros)
    if payload["audio"] in cols and "sample_rate" in cols:
        rate_valid = valid_mask(cols["sample_rate"])
        rate = as_ints(cols["sample_rate"], "sample_rate")
        bad |= has["audio"] & (~rate_valid | (rate <= 0) | (rate < MIN_SAMPLE_RATE) | (rate > MAX_SAMPLE_RATE))
        if "num_frames" not in cols and is_list(cols[payload["audio"]].type):
            frames = audio_frames(list_lengths(cols[payload["audio"]]), np.maximum(rate, 1))
            num_frames = np.where(has["audio"], frames, 0)
    return {"ids": ids, "id_valid": id_valid, "mask": mask, "bad": bad,
            "num_tokens": num_tokens, "num_patches": counts.get("num_patches", zeros), "num_frames": num_frames}


# The least count a row with the modality can hold: an image decodes to one patch at least (found
# in QA: num_patches 0 on an image trained, and only `validate --payloads` said it); a clip too short
# for one frame is one the audio stage takes.
LEAST = {"num_patches": (1, "an image gives 1 patch or more: loaders.dali.num_patches counts them"),
         "num_frames": (0, "a count: 0 or more")}


def describe_bad_row(cols: dict[str, pa.Array], j: int, row: int, payload: dict[str, str]) -> str:
    """One line on why row `row` (local index `j`) is bad; called only for the first bad row."""
    rid = cols["id"][j].as_py()
    if rid is None:
        return f"row {row} has a null id"
    where = f"row {row} (id {rid})"
    mods = cols["modalities"][j].as_py()
    if mods is None:
        return f"{where} has null modalities (a text-only row is [\"text\"])"
    if not mods:
        return f"{where} declares no modalities (a text-only row is [\"text\"])"
    unknown = [m for m in mods if m not in KNOWN_MODALITIES]
    if unknown:
        return f"{where} has unknown modality {unknown[0]!r} (known: {', '.join(KNOWN_MODALITIES)})"
    if not cols["tokens"][j].is_valid:
        return f"{where} has null tokens"
    tokens = cols["tokens"][j].values
    if len(tokens) == 0:
        return f"{where} has no tokens"
    if tokens.null_count:
        return f"{where} has a null token id (at position {tokens.to_pylist().index(None)})"
    outside = [t for t in tokens.to_pylist() if not 0 <= t < INT32_END]
    if outside:
        return f"{where} has token id {outside[0]}, outside 0..{INT32_END - 1} (token ids are read as int32)"
    for modality in ("image", "audio"):
        column = payload[modality]
        present = column in cols and bool(valid_mask(cols[column].slice(j, 1))[0])  # an encoded null too
        if modality in mods and not present:
            what = f"column {column!r} is null" if column in cols else f"there is no {column!r} column"
            return f"{where} declares modality {modality!r} but {what}"
        if present and modality not in mods:
            return f"{where} has a value in column {column!r} but {modality!r} is not in its modalities"
        if present and payload_lengths(cols[column].slice(j, 1))[0] == 0:
            return f"{where} has an empty {modality} in column {column!r} (no bytes or values)"
        listed = is_list(cols[column].type) or pa.types.is_fixed_size_list(cols[column].type) if present else False
        if listed and rows_with_null_values(cols[column].slice(j, 1))[0]:
            return f"{where} has a null element in column {column!r}"
        if listed and rows_with_non_finite(cols[column].slice(j, 1))[0]:
            return f"{where} has a NaN or infinite value in column {column!r}"
    for column, modality in (("num_patches", "image"), ("num_frames", "audio")):
        if column in cols and modality in mods:
            value = cols[column][j].as_py()
            least, said = LEAST[column]
            if value is None or value < least:
                return f"{where} has {modality} but {column} {value} ({said})"
    if "audio" in mods:
        rate = cols["sample_rate"][j].as_py() if "sample_rate" in cols else None
        if rate is None or rate <= 0:
            return f"{where} has audio but no positive sample_rate"
        if rate < MIN_SAMPLE_RATE:
            hint = " (kHz given as Hz?)" if rate < 200 else ""  # found in QA: a hint that misled for 500
            return f"{where} has sample_rate {rate}, below {MIN_SAMPLE_RATE} Hz{hint}"
        return f"{where} has sample_rate {rate}, above {MAX_SAMPLE_RATE} Hz (a sample count, not a rate?)"
    return f"{where} is inconsistent"


def check_unique(ids: np.ndarray, path: str) -> None:
    if len(ids) < 2:
        return
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    dup = np.nonzero(sorted_ids[1:] == sorted_ids[:-1])[0]
    if len(dup):
        # Report the duplicate whose second occurrence comes first in file order.
        first = dup[np.argmin(order[dup + 1])]
        raise PipelineError(f"data.path: id {int(sorted_ids[first])} appears more than once in {path} "
                            "(ids must be unique)")


def extract(arr: pa.Array, local: np.ndarray, *, as_int32: bool = False) -> list[Any]:
    """Values of `arr` at `local` indices: numeric lists as numpy views, everything else via as_py.
    A row of integers holding a null element comes back as a list (None for the null): numpy's
    own conversion would turn every row of the segment into float64 (a float row: NaN there)."""
    t = arr.type
    fixed = pa.types.is_fixed_size_list(t)  # found in review: reached the stage as a Python list
    if (is_list(t) or fixed) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        # Absolute positions into arr.values (a fixed-size list's child starts at the array's own offset 0).
        offsets = ((np.arange(len(arr) + 1) + arr.offset) * t.list_size if fixed
                   else arr.offsets.to_numpy(zero_copy_only=False))
        values = arr.values
        holes = values.null_count and pa.types.is_integer(t.value_type)
        flat = (pc.fill_null(values, 0) if holes else values).to_numpy(zero_copy_only=values.null_count == 0)
        valid = valid_mask(arr)
        rows = [flat[offsets[j]:offsets[j + 1]] if valid[j] else None for j in local.tolist()]
        if holes:
            filled = ~valid_mask(values)
            rows = [arr[j].as_py() if r is not None and filled[offsets[j]:offsets[j + 1]].any() else r
                    for j, r in zip(local.tolist(), rows, strict=True)]
        if as_int32 and flat.dtype != np.int32:  # cast only the rows asked for, not the whole segment
            rows = [r.astype(np.int32) if isinstance(r, np.ndarray) else r for r in rows]
        return rows
    return [arr[j].as_py() for j in local.tolist()]
