"""The shape rule of the streamed kernels' `auto` settings (no GPU)."""

from __future__ import annotations

from asyncspec.layers.streamed_shapes import one_tile_per_sm, share_fits_ring


def test_one_tile_per_sm_is_the_measured_rule() -> None:
    # An H100's 132 SMs: the 1B's down projection (128 tiles) streamed faster, the 8B's (256 tiles) and the bundled
    # target's (24 tiles) slower.
    assert one_tile_per_sm({(2048, 8192)}, 132)
    assert not one_tile_per_sm({(4096, 14336)}, 132)
    assert not one_tile_per_sm({(384, 1024)}, 132)
    assert one_tile_per_sm({(2048, 4096)}, 132) and not one_tile_per_sm({(2048, 3840)}, 132)  # tiles of < 128 KiB
    assert one_tile_per_sm({(2112, 8192)}, 132) and not one_tile_per_sm({(2120, 8192)}, 132)
    assert one_tile_per_sm({(1056, 8192)}, 132) and not one_tile_per_sm({(1040, 8192)}, 132)  # 66 and 65 tiles
    assert not one_tile_per_sm({(2048, 8192), (4096, 8192)}, 132)  # every shape must hold
    assert not one_tile_per_sm(set(), 132)


def test_share_fits_ring_is_the_measured_rule() -> None:
    def ring(k: int) -> int:
        return 64 * 1024  # the o projection's 8 slots of one 8 KiB box

    # An H100's 132 SMs: the 1B's o projection (128 tiles of 64 KiB, one a program) streamed faster, the 8B's (256
    # tiles of 128 KiB, two a program) slower.
    assert share_fits_ring({(2048, 2048)}, 132, ring)
    assert not share_fits_ring({(4096, 4096)}, 132, ring)
    assert share_fits_ring({(132 * 16, 2048)}, 132, ring) and not share_fits_ring({(133 * 16, 2048)}, 132, ring)
    assert share_fits_ring({(264 * 16, 1024)}, 132, ring) and not share_fits_ring({(265 * 16, 1024)}, 132, ring)
    assert not share_fits_ring({(2048, 2048), (2048, 4096)}, 132, ring)  # every shape must hold
    assert share_fits_ring({(2048, 4096)}, 132, lambda k: k * 32)  # the ring the caller gives for each K
    assert not share_fits_ring(set(), 132, ring)
