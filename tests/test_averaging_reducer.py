import pytest
import torch

from hivemind_ext.averaging.allreduce.reducer import PartReducer
from hivemind_ext.compression import Float16Compression, NoCompression
from hivemind_ext.errors import AllreduceError, ProtocolError

PART, CHUNK = 10, 4


def chunks(values: torch.Tensor, codec=None):
    codec = codec or NoCompression()
    return [codec.compress(values[start : start + CHUNK]) for start in range(0, PART, CHUNK)]


def slices(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(PART, generator=generator) for _ in range(n)]


def test_weighted_mean_over_all_senders_interleaved() -> None:
    data, weights = slices(3), {"a": 1.0, "b": 2.0, "c": 0.5}
    reducer = PartReducer(PART, CHUNK, weights)
    messages = {s: chunks(x) for s, x in zip(weights, data, strict=True)}
    for index in (2, 0, 1):  # chunks may arrive in any order
        for sender in ("c", "a", "b"):
            reducer.accept(sender, index, messages[sender][index])
    result = reducer.finalize()
    expected = sum(w * x for w, x in zip(weights.values(), data, strict=True)) / sum(weights.values())
    torch.testing.assert_close(result.values, expected)
    assert result.contributors == ("a", "b", "c") and result.total_weight == 3.5


def test_sender_failing_mid_part_is_retracted_exactly() -> None:
    data, weights = slices(3), {"a": 1.0, "b": 3.0, "c": 2.0}
    reducer = PartReducer(PART, CHUNK, weights)
    messages = {s: chunks(x, Float16Compression()) for s, x in zip(weights, data, strict=True)}
    for sender in "ac":
        for index in range(3):
            reducer.accept(sender, index, messages[sender][index])
    reducer.accept("b", 0, messages["b"][0])
    reducer.accept("b", 1, messages["b"][1])
    reducer.exclude("b", "connection lost")
    result = reducer.finalize()
    decoded = [torch.cat([m.payload.view(torch.float16).float() for m in messages[s]]) for s in "ac"]
    torch.testing.assert_close(result.values, (1.0 * decoded[0] + 2.0 * decoded[1]) / 3.0)
    assert result.contributors == ("a", "c") and reducer.excluded == {"b": "connection lost"}


@pytest.mark.parametrize(
    "bad",
    [
        lambda: (7, NoCompression().compress(torch.zeros(CHUNK))),  # index out of range
        lambda: (0, NoCompression().compress(torch.zeros(CHUNK + 1))),  # wrong length
        lambda: (0, NoCompression().compress(torch.zeros(CHUNK, dtype=torch.int64))),  # wrong dtype
        lambda: (0, NoCompression().compress(torch.full((CHUNK,), float("nan")))),  # NaN
        lambda: (2, NoCompression().compress(torch.full((2,), float("inf")))),  # Inf
    ],
)
def test_invalid_chunks_exclude_the_sender_and_keep_the_others(bad) -> None:
    data = slices(2)
    reducer = PartReducer(PART, CHUNK, {"good": 1.0, "bad": 1.0})
    reducer.accept("bad", 1, chunks(data[1])[1])
    with pytest.raises(ProtocolError):
        reducer.accept("bad", *bad())
    with pytest.raises(ProtocolError):  # no more chunks from an excluded sender
        reducer.accept("bad", 0, chunks(data[1])[0])
    for index, message in enumerate(chunks(data[0])):
        reducer.accept("good", index, message)
    result = reducer.finalize()
    torch.testing.assert_close(result.values, data[0])
    assert result.contributors == ("good",)


def test_duplicates_unknown_senders_and_premature_finalize() -> None:
    data = slices(1)[0]
    reducer = PartReducer(PART, CHUNK, {"a": 1.0})
    with pytest.raises(ProtocolError):
        reducer.accept("stranger", 0, chunks(data)[0])
    reducer.accept("a", 0, chunks(data)[0])
    with pytest.raises(AllreduceError):
        reducer.finalize()
    with pytest.raises(ProtocolError):
        reducer.accept("a", 0, chunks(data)[0])
    with pytest.raises(AllreduceError):  # the only sender was excluded for the duplicate
        reducer.finalize()


def test_empty_part_is_immediately_complete() -> None:
    with pytest.raises(AllreduceError):  # nobody contributed anything, not even weight
        PartReducer(0, CHUNK, {}).finalize()
    result = PartReducer(0, CHUNK, {"a": 1.0}).finalize()
    assert result.values.numel() == 0 and result.contributors == ("a",)
