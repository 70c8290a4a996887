import timeit, torch
from precisionloop import policy as P, _compat as C
acc = C.backend_flag_accessors()
names = ["matmul", "conv", "rnn", "benchmark"]
vals = [("tf32", "ieee")] * 3 + [(True, False)]
for (get, set_), name, (a, b) in zip(acc, names, vals):
    st = [0]
    def tog():
        st[0] ^= 1; set_(a if st[0] else b)
    print(f"set {name:<10} {min(timeit.repeat(tog, number=5000, repeat=3)) / 5000 * 1e6:6.2f} us   get {min(timeit.repeat(get, number=5000, repeat=3)) / 5000 * 1e6:6.2f} us")
st = [0]
def ctog():
    st[0] ^= 1; torch._C._set_fp32_precision_setter("cuda", "matmul", "tf32" if st[0] else "ieee")
print("C set matmul", min(timeit.repeat(ctog, number=5000, repeat=3)) / 5000 * 1e6)
def btog():
    st[0] ^= 1; torch._C._set_cudnn_benchmark(bool(st[0]))
print("C set bench", min(timeit.repeat(btog, number=5000, repeat=3)) / 5000 * 1e6)
