"""Print what the scan lowering emits for a few tiles, without a GPU: vector loads, warp
shuffles and shared-memory stores in sm_90 PTX for each lane order of a reverse scan (the
counting is rl_triton/testing/lowering.py, loaded by its file path so that this runs without
torch).

    python benchmarks/scan_ptx.py [--tiles 4x128x4,2x512x2]   # BLOCK_R x BLOCK_T x num_warps
"""

import importlib.util
import os

from common import parser

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rl_triton", "testing", "lowering.py")
_spec = importlib.util.spec_from_file_location("lowering", _path)
lowering = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lowering)


def main():
    p = parser(__doc__)
    p.add_argument("--tiles", default="4x128x4,1x256x1,2x512x2", help="BLOCK_RxBLOCK_Txnum_warps, comma-separated")
    args = p.parse_args()
    print(f"triton {lowering.triton.__version__}, sm_90 PTX")
    print("| tile | lanes | vector loads / loads | warp shuffles | shared-memory stores |")
    print("|---|---|---|---|---|")
    for tile in args.tiles.split(","):
        block_r, block_t, warps = map(int, tile.split("x"))
        for mode, name in lowering.MODES.items():
            v4, loads, shfl, sts = lowering.counts(block_r, block_t, warps, mode)
            print(f"| {block_r}x{block_t}, {warps} warp{'s' if warps > 1 else ''} | {name} | {v4} / {loads} | {shfl} | {sts} |")


if __name__ == "__main__":
    main()
