// compact.wgsl: the gather half of KV-cache compaction. Copies the rows named
// by a sorted keep list into a scratch buffer: row i of the kept data is source
// slot keep[i], each row `row_len` u32 words (a slot's keys of one layer, its
// values, or any other per-slot data). The caller then copies the scratch rows
// back to rows 0..n_keep of the per-slot buffer with copy_buffer_to_buffer,
// after the pass. Reading only `src` and writing only `dst` makes the gather
// race-free however workgroups are scheduled (an in-place gather is not: a
// destination row can be another workgroup's unread source).
//
// Keep lists: the cache may keep a different set of entries per layer or per
// (layer, KV head) (`--granularity`). `keep` then holds n_lists lists of
// n_keep each, back to back; a row is split into sub-rows of `sub_len` words,
// and sub-row j takes list `list_first + j` (a layer's K row: one sub-row per
// KV head; the per-list slot positions: one word per list). A row taken
// whole by one list has sub_len = row_len.
//
// A per-slot buffer may be split into pages (src/kernels/paging.rs). One
// dispatch gathers the kept rows dst_first .. dst_first + dst_len (those that
// go to one destination page) whose source slot lies in the bound source page
// src_first .. src_first + src_len; the caller dispatches once per (destination
// page, source page). Rows from other source pages are left to their dispatch.
//
// Bindings (group 0):
//   0 r     uniform Refresh       (n_keep)
//   1 p     uniform CompactParams
//   2 keep  storage read  [n_lists, n_keep] u32  source slot of kept row i
//                         (each list ascending)
//   3 src   storage read  [src_len, row_len] u32  one source page
//   4 dst   storage rw    [.., row_len] u32  scratch; kept row dst_first + j goes
//                         to dst_offset + j * row_len
// Dispatch: (ceil(row_len / 64), dst_len, 1).
struct Refresh {
    n_keep: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

struct CompactParams {
    row_len: u32,
    dst_offset: u32,
    dst_first: u32,
    dst_len: u32,
    src_first: u32,
    src_len: u32,
    // Words per sub-row, and the list of sub-row 0.
    sub_len: u32,
    list_first: u32,
}

@group(0) @binding(0) var<uniform> r: Refresh;
@group(0) @binding(1) var<uniform> p: CompactParams;
@group(0) @binding(2) var<storage, read> keep: array<u32>;
@group(0) @binding(3) var<storage, read> src: array<u32>;
@group(0) @binding(4) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let w = gid.x;
    let j = gid.y;
    let i = p.dst_first + j;
    if (w >= p.row_len || j >= p.dst_len || i >= r.n_keep) {
        return;
    }
    let list = p.list_first + w / p.sub_len;
    let s = keep[list * r.n_keep + i];
    if (s < p.src_first || s - p.src_first >= p.src_len) {
        return;
    }
    dst[p.dst_offset + j * p.row_len + w] = src[(s - p.src_first) * p.row_len + w];
}
