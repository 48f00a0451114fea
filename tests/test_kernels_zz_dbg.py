import sys
def test_x():
    print([m for m in sys.modules if 'optimus' in m])
    import optimus.kernels.triton_kernels as tk
    print(type(tk._expert_tile))
