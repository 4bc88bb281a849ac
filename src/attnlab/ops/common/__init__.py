"""What the op families share, each in a module named for it: the dtypes ops compute in (`precision`),
grouped heads (`heads`), the argument checks of dot-product inputs (`args`), packed documents
(`packed`), query chunks and their key bands (`band`), torch's fused attention kernels (`sdpa`), and
the Triton kernels' shared arithmetic (`triton_math`), row addressing (`triton_rows`) and where they
run (`triton_route`). Nothing here imports an op family."""
