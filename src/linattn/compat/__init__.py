"""Other libraries' APIs on linattn's operators.

    fla   flash-linear-attention's functions (`fla.ops.*`: chunk_gated_delta_rule, chunk_gla, …) and
          Dao's causal-conv1d (`causal_conv1d_fn`, `causal_conv1d_update`), with their names,
          signatures, defaults and (B, T, H, D) layout, running linattn's kernels (design §18).

Nothing here is imported by `import linattn`; `import linattn.compat.fla` does not import `fla`.
"""
