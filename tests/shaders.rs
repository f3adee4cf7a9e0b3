//! Every kernel under shaders/ (with each format prelude it can take) is
//! parsed and validated by naga and translated to SPIR-V (Vulkan), MSL (Metal)
//! and HLSL (DX12), so a shader that would break on another backend fails here.

use sieve::shaders::{self, WeightStore};

/// (name, source, uses cooperative matrices) for every kernel module:
/// weights in every format, quantized ones included, from a buffer and
/// from a texture; the KV cache in f16 and f32.
fn variants() -> Vec<(String, String, bool)> {
    shaders::modules()
        .iter()
        .map(|m| {
            let coop = shaders::uses_cooperative_matrices(m.shader);
            (m.file_name(), m.source(), coop)
        })
        .collect()
}

#[test]
fn every_shader_validates_and_translates() {
    let all = variants();
    assert!(all.len() >= 9, "expected every kernel, got {}", all.len());
    assert!(
        all.iter().any(|v| v.2),
        "the cooperative-matrix kernel is in the list"
    );
    for (name, src, coop) in all {
        let module =
            shaders::parse(&src).unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&src)));
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}: validation: {e:?}"));
        // Override constants are resolved as wgpu does when it builds a
        // pipeline: a kernel's defaults, and its wide tiles where it has them
        // (WIDE sizes workgroup arrays and picks code paths).
        let mut constant_sets = vec![naga::back::PipelineConstants::default()];
        if src.contains("override WIDE") {
            constant_sets.push([("WIDE".to_string(), 2.0)].into_iter().collect());
        }
        for constants in &constant_sets {
            let name = format!("{name} {constants:?}");
            let (module, info) =
                naga::back::pipeline_constants::process_overrides(&module, &info, None, constants)
                    .unwrap_or_else(|e| panic!("{name}: overrides: {e}"));
            let spv = naga::back::spv::write_vec(&module, &info, &Default::default(), None)
                .unwrap_or_else(|e| panic!("{name}: SPIR-V: {e}"));
            assert!(spv.len() > 16, "{name}: empty SPIR-V");
            let msl_opts = naga::back::msl::Options {
                fake_missing_bindings: true,
                // Metal's simdgroup matrices need MSL 2.3.
                lang_version: if coop { (2, 3) } else { (1, 0) },
                ..Default::default()
            };
            let (msl, _) =
                naga::back::msl::write_string(&module, &info, &msl_opts, &Default::default())
                    .unwrap_or_else(|e| panic!("{name}: MSL: {e}"));
            assert!(msl.contains("kernel"), "{name}: MSL has no kernel");
            let mut hlsl = String::new();
            let hlsl_opts = naga::back::hlsl::Options::default();
            let pipe = naga::back::hlsl::PipelineOptions::default();
            let written = naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_opts, &pipe)
                .write(&module, &info, None);
            if coop {
                // naga has no cooperative matrices for DX12; wgpu never offers the
                // feature there, so this kernel is never selected on DX12.
                assert!(written.is_err(), "{name}: HLSL unexpectedly written");
                continue;
            }
            written.unwrap_or_else(|e| panic!("{name}: HLSL: {e}"));
            assert!(
                hlsl.contains("numthreads"),
                "{name}: HLSL has no compute entry"
            );
        }
    }
}

/// Every kernel file documents its bindings and dispatch in its header.
#[test]
fn every_shader_has_a_header() {
    for s in shaders::all() {
        let head: String = s
            .body
            .lines()
            .take_while(|l| l.starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            head.contains("Bindings") && head.contains("Dispatch"),
            "{} lacks a header",
            s.file
        );
    }
}

/// The shader list is complete: every .wgsl under shaders/ is either a kernel
/// or a prelude.
#[test]
fn shader_list_covers_the_folder() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let preludes = [
        "shaders/common.wgsl",
        "shaders/weights_f16.wgsl",
        "shaders/weights_f32.wgsl",
        "shaders/weights_q8_0.wgsl",
        "shaders/weights_q4_0.wgsl",
        "shaders/weights_q4_1.wgsl",
        "shaders/weights_q5_0.wgsl",
        "shaders/weights_q4_k.wgsl",
        "shaders/weights_q5_k.wgsl",
        "shaders/weights_q6_k.wgsl",
        "shaders/weights_blocks.wgsl",
        "shaders/weights_floats.wgsl",
        "shaders/weights_buffer.wgsl",
        "shaders/weights_texture.wgsl",
        "shaders/weights_texture_u32.wgsl",
        "shaders/weights_texture_f16.wgsl",
        "shaders/weights_texture_f32.wgsl",
        "shaders/weights_texture_u32x4.wgsl",
        "shaders/weights_words.wgsl",
        "shaders/weights_rows.wgsl",
        "shaders/kv_f16.wgsl",
        "shaders/kv_f32.wgsl",
        "shaders/matmul_io.wgsl",
        "shaders/matmul_x.wgsl",
        "shaders/matmul_x16.wgsl",
        "shaders/x_input.wgsl",
        "shaders/matvec_rows.wgsl",
        "shaders/matvec_sums.wgsl",
        "shaders/attention_heads.wgsl",
        "shaders/attention_heads_wide.wgsl",
        "shaders/attention_io.wgsl",
        "shaders/attention_decode_io.wgsl",
        "shaders/x_copy_io.wgsl",
    ];
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = format!("shaders/{}", entry.unwrap().file_name().to_string_lossy());
        assert!(
            preludes.contains(&name.as_str()) || shaders::all().iter().any(|s| s.file == name),
            "{name} is not registered in src/shaders.rs"
        );
    }
}

/// Every host-side uniform struct matches, field by field, the WGSL struct it
/// mirrors as naga lays it out, in every kernel that declares it: same names
/// at the same byte offsets with the same scalar types (padding, named `_..`
/// on either side, may differ in name), and the same total size.
#[test]
fn host_uniform_structs_match_their_wgsl_layout() {
    let layouts = sieve::kernels::uniform_layouts();
    assert!(
        layouts.len() >= 12,
        "expected every uniform struct, got {}",
        layouts.len()
    );
    for layout in &layouts {
        for shader in &layout.shaders {
            // f16: the first format of each list.
            let format = shaders::formats(shader)[0];
            let src = shaders::source(shader, format, WeightStore::Buffer);
            let module = shaders::parse(&src)
                .unwrap_or_else(|e| panic!("{}: {}", shader.file, e.emit_to_string(&src)));
            let what = format!(
                "{} against {} in {}",
                layout.host, layout.wgsl_struct, shader.file
            );
            let (members, span) = module
                .types
                .iter()
                .find_map(|(_, t)| match &t.inner {
                    naga::TypeInner::Struct { members, span }
                        if t.name.as_deref() == Some(layout.wgsl_struct) =>
                    {
                        Some((members, *span))
                    }
                    _ => None,
                })
                .unwrap_or_else(|| panic!("{what}: no such struct in the WGSL"));
            assert_eq!(span as usize, layout.size, "{what}: size");
            let wgsl: Vec<(&str, usize, &str)> = members
                .iter()
                .map(|m| {
                    let scalar = match module.types[m.ty].inner {
                        naga::TypeInner::Scalar(naga::Scalar {
                            kind: naga::ScalarKind::Uint,
                            width: 4,
                        }) => "u32",
                        naga::TypeInner::Scalar(naga::Scalar {
                            kind: naga::ScalarKind::Float,
                            width: 4,
                        }) => "f32",
                        ref other => panic!("{what}: member type {other:?} has no host mirror"),
                    };
                    (m.name.as_deref().unwrap_or(""), m.offset as usize, scalar)
                })
                .collect();
            let is_padding = |name: &str| name.starts_with('_');
            for f in layout.fields.iter().filter(|f| !is_padding(f.name)) {
                assert!(
                    wgsl.contains(&(f.name, f.offset, f.scalar)),
                    "{what}: host field {} ({} at byte {}) has no WGSL member of that name, type and offset; WGSL has {wgsl:?}",
                    f.name,
                    f.scalar,
                    f.offset
                );
            }
            for (name, offset, _) in wgsl.iter().filter(|m| !is_padding(m.0)) {
                assert!(
                    layout
                        .fields
                        .iter()
                        .any(|f| f.name == *name && f.offset == *offset),
                    "{what}: WGSL member {name} at byte {offset} has no host field"
                );
            }
        }
    }
}

/// Every loop ends whatever the buffers hold (the rule in common.wgsl, on
/// which compiling without wgpu's loop counters rests): a loop counts by one
/// to a strict bound, halves down to zero, or counts in larger steps (of
/// constants, or `stride` and `lanes`, which the kernels clamp or derive
/// from constants) up to constants, to a bound taken through `bounded(..)`,
/// or to one the loop says is small (`// loop bound: ...`).
#[test]
fn every_loop_has_a_bound_that_cannot_wrap() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let idents = |e: &str| -> Vec<String> {
        e.split(|c: char| !is_word(c))
            .filter(|w| !w.is_empty() && !w.starts_with(|c: char| c.is_ascii_digit()))
            .map(String::from)
            .collect()
    };
    let constant = |w: &str| {
        w.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    };
    let mut loops = 0;
    let mut bad = vec![];
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            let words = idents(code);
            let at = format!("{name}:{}", i + 1);
            assert!(
                !words.iter().any(|w| w == "while" || w == "loop"),
                "{at}: only for loops are checked"
            );
            if !words.iter().any(|w| w == "for") {
                continue;
            }
            let open = code.find("for").and_then(|f| {
                let rest = code[f + 3..].trim_start();
                rest.starts_with('(').then(|| code.len() - rest.len() + 1)
            });
            let open = open.unwrap_or_else(|| panic!("{at}: a for loop's header on one line"));
            let header = &code[open..code.rfind(')').unwrap_or(code.len())];
            let parts: Vec<&str> = header.split(';').map(str::trim).collect();
            assert_eq!(parts.len(), 3, "{at}: a for loop's header on one line");
            loops += 1;
            let (init, cond, step) = (parts[0], parts[1], parts[2]);
            let var = init
                .strip_prefix("var ")
                .unwrap_or(cond)
                .split(|c: char| !is_word(c))
                .next()
                .unwrap();
            assert!(
                !cond.contains("||")
                    && !cond.contains("&&")
                    && !cond.contains('=')
                    && !cond.contains('!'),
                "{at}: a loop condition is one strict comparison"
            );
            let by_one = step == format!("{var}++") && cond.starts_with(&format!("{var} < "));
            let halves = (step == format!("{var} /= 2u") || step == format!("{var} = {var} / 2u"))
                && cond == format!("{var} > 0u");
            // Larger steps: constants, or `stride` (clamped below 2^24 in
            // read_bandwidth.wgsl) or `lanes` (4 x SUBGROUP_SIZE).
            let larger = step.strip_prefix(&format!("{var} += ")).is_some_and(|e| {
                idents(e)
                    .iter()
                    .all(|w| constant(w) || w == "stride" || w == "lanes")
            });
            let constant_bound = idents(cond).iter().all(|w| w == var || constant(w));
            let clamped = cond.matches('<').count() == 1
                && cond
                    .split('<')
                    .nth(1)
                    .unwrap()
                    .trim()
                    .starts_with("bounded(")
                && cond.ends_with(')');
            let annotated = line
                .split("// loop bound: ")
                .nth(1)
                .is_some_and(|r| !r.trim().is_empty());
            let ok = by_one || halves || (larger && (constant_bound || clamped || annotated));
            if !ok {
                bad.push(format!("{at}: {}", line.trim()));
            }
        }
    }
    assert!(loops > 100, "{loops} loops found");
    assert!(
        bad.is_empty(),
        "loops that might not end:\n{}",
        bad.join("\n")
    );
}

/// The kernels that read textures find texel t at (t & (width - 1),
/// t >> shift): each shift constant must be log2 of the width the host
/// gives its textures (src/weights.rs: WEIGHT_TEXTURE_WIDTH).
#[test]
fn texture_shifts_match_the_texture_width() {
    let width = sieve::weights::WEIGHT_TEXTURE_WIDTH;
    for (file, name) in [
        ("weights_texture.wgsl", "W_TEXTURE_SHIFT"),
        ("read_bandwidth_texture.wgsl", "PROBE_TEXTURE_SHIFT"),
    ] {
        let path = format!("{}/shaders/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let decl = format!("const {name}: u32 = ");
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(&decl))
            .unwrap_or_else(|| panic!("{file}: no `{decl}...`"));
        let shift: u32 = line
            .trim_end_matches(';')
            .trim_end_matches('u')
            .parse()
            .unwrap();
        assert_eq!(1u32 << shift, width, "{file}: {name} = {shift}");
    }
}

/// Every module states the extensions it uses, as the WGSL specification
/// (and Tint, Dawn's compiler) requires and naga does not: subgroup
/// builtins and functions need `enable subgroups;`, the f16 type
/// `enable f16;`. A module without such a use has no such `enable`.
#[test]
fn every_module_states_its_extensions() {
    let uses = |code: &str, words: &[&str]| {
        code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| words.iter().any(|p| w.starts_with(p)))
    };
    let mut with_subgroups = 0;
    for m in shaders::modules() {
        let src = m.source();
        // The code without its comments and its `enable`s.
        let (enables, code): (Vec<&str>, Vec<&str>) = src
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .partition(|l| l.starts_with("enable "));
        let code = code.join("\n");
        let name = m.file_name();
        let subgroups = uses(&code, &["subgroup", "num_subgroups"]);
        let f16 = code
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| w == "f16");
        assert_eq!(
            enables.contains(&"enable subgroups;"),
            subgroups,
            "{name}: subgroup builtins without `enable subgroups;`, or the reverse"
        );
        assert_eq!(
            enables.contains(&"enable f16;"),
            f16,
            "{name}: the f16 type without `enable f16;`, or the reverse"
        );
        with_subgroups += subgroups as usize;
    }
    assert!(
        with_subgroups >= 4,
        "{with_subgroups} modules use subgroups"
    );
}

/// WebGPU's default limits are enough for every kernel: in particular at
/// most 8 storage buffers per stage, which a new kernel binding more would
/// raise for every run (`check_limits` takes the most over all shaders).
#[test]
fn every_shader_fits_webgpus_default_limits() {
    let defaults = wgpu::Limits::default();
    assert_eq!(defaults.max_storage_buffers_per_shader_stage, 8);
    sieve::gpu::check_limits(&defaults).unwrap();
}
