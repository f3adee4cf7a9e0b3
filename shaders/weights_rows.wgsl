// weights_rows.wgsl: where row r of a part of K = 4 k4 values starts, in the
// prelude's flat groups of four values (appended to every weight-format
// prelude, see src/shaders.rs): rows start at multiples of W_ROW_ALIGN
// groups, which the prelude sets (1: back to back; Q4_0: 64, whole
// 256-value groups of blocks, src/quant.rs). Kernels find row r's group i
// at w_row(r, k4) + i.

fn w_row(r: u32, k4: u32) -> u32 {
    return r * ((k4 + W_ROW_ALIGN - 1u) / W_ROW_ALIGN * W_ROW_ALIGN);
}
