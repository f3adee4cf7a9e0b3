// compact.wgsl: the gather half of KV-cache compaction. Copies the rows named
// by a sorted keep list into a scratch buffer: dst[dst_offset + i] = src[keep[i]]
// for i < n_keep, each row `row_len` u32 words (a slot's keys of one layer, its
// values, or any other per-slot data). The caller then copies the scratch rows
// back to rows 0..n_keep of the source with copy_buffer_to_buffer, after the pass.
// Reading only `src` and writing only `dst` makes the gather race-free however
// workgroups are scheduled (an in-place gather is not: a destination row can be
// another workgroup's unread source).
//
// Bindings (group 0):
//   0 r     uniform Refresh       (n_keep)
//   1 p     uniform CompactParams (row_len in u32 words, dst_offset in u32 words)
//   2 keep  storage read  [n_keep] u32  source slot of destination row i
//   3 src   storage read  [slots, row_len] u32
//   4 dst   storage rw    [.., row_len] u32
// Dispatch: (ceil(row_len / 64), n_keep, 1).
struct Refresh {
    n_keep: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

struct CompactParams {
    row_len: u32,
    dst_offset: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> r: Refresh;
@group(0) @binding(1) var<uniform> p: CompactParams;
@group(0) @binding(2) var<storage, read> keep: array<u32>;
@group(0) @binding(3) var<storage, read> src: array<u32>;
@group(0) @binding(4) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = gid.x;
    let i = gid.y;
    if (w >= p.row_len || i >= r.n_keep) {
        return;
    }
    dst[p.dst_offset + i * p.row_len + w] = src[keep[i] * p.row_len + w];
}
