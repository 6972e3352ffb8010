"""The systems table's rows that run the same exchange differ only where they say: the flat
and the one-chunk pipelined expert parallelism send the same bytes in the same messages;
the flat one computes its capacity buffer's empty slots too."""

import pytest

from minipar.moe.systems_bench import System, _step


@pytest.mark.parametrize("tokens", [64])
def test_flat_and_one_chunk_share_the_traffic_not_the_buffer(cluster4, tokens):
    flat = cluster4.run(_step, System("EP", exchange="flat"), tokens, 1)
    one_chunk = cluster4.run(_step, System("EP", exchange="pipelined", chunks=1), tokens, 1)
    for mine, theirs in zip(flat, one_chunk, strict=True):
        assert mine["bytes_per_step"] == theirs["bytes_per_step"]
        assert mine["messages_per_step"] == theirs["messages_per_step"] > 0
        assert mine["rows"] == theirs["rows"] == theirs["computed"]
        assert mine["computed"] >= mine["rows"]
    assert sum(r["computed"] for r in flat) > sum(r["rows"] for r in flat)  # empty slots
