//! SPIR-V that sieve writes itself for the cooperative-matrix kernels on
//! Vulkan, under the GLSL450 memory model.
//!
//! Why: naga (wgpu 30) declares the Vulkan memory model in any module that
//! uses cooperative matrices, but keeps writing what the GLSL450 model
//! means: workgroup loads and stores without `NonPrivatePointer`, barriers
//! without `MakeAvailable` / `MakeVisible` (wgpu issue 8805). Under the
//! Vulkan model those accesses are private to their invocation, so a
//! workgroup barrier does not order them between invocations, and a kernel
//! that stages tiles in workgroup memory (`matmul_coop_staged.wgsl`,
//! `attention_prefill_coop.wgsl`, and x in `matmul_coop.wgsl`) has data
//! races a driver's compiler may act on. SPV_KHR_cooperative_matrix does not
//! need the Vulkan memory model (SPIRV-Tools' validator accepts these kernels
//! under GLSL450, and llama.cpp's GLSL cooperative-matrix shaders compile
//! to GLSL450 SPIR-V too), so [`glsl450_memory_model`] takes the declaration
//! back out, where every barrier means what it means in every other kernel.
//! The module, written by [`kernel_spirv`] with the options wgpu itself
//! uses, then reaches the driver through wgpu's passthrough
//! ([`Gpu::pipeline`](crate::gpu::Gpu::pipeline)).
//!
//! The rewrite refuses a module that uses anything only the Vulkan memory
//! model defines (memory-access or memory-semantics bits of its own, the
//! queue-family scope, atomics, memory copies), so it can never change what
//! an instruction means, only remove a declaration nothing relies on.

use anyhow::{anyhow, bail, ensure, Context, Result};
use std::collections::HashMap;

const OP_EXTENSION: u16 = 10;
const OP_MEMORY_MODEL: u16 = 14;
const OP_CAPABILITY: u16 = 17;
const OP_CONSTANT: u16 = 43;
const OP_LOAD: u16 = 61;
const OP_STORE: u16 = 62;
const OP_COPY_MEMORY: u16 = 63;
const OP_COPY_MEMORY_SIZED: u16 = 64;
const OP_CONTROL_BARRIER: u16 = 224;
const OP_MEMORY_BARRIER: u16 = 225;
/// OpAtomicLoad .. OpAtomicXor, then OpAtomicFlagTestAndSet / Clear and the
/// float atomics of SPV_EXT_shader_atomic_float(_min_max).
const OP_ATOMICS: [(u16, u16); 4] = [(227, 242), (318, 319), (5614, 5615), (6035, 6035)];
const OP_COOP_LOAD: u16 = 4457;
const OP_COOP_STORE: u16 = 4458;

const CAPABILITY_VULKAN_MEMORY_MODEL: u32 = 5345;
const MEMORY_MODEL_GLSL450: u32 = 1;
const MEMORY_MODEL_VULKAN: u32 = 3;
const EXTENSION_VULKAN_MEMORY_MODEL: &str = "SPV_KHR_vulkan_memory_model";
/// Memory-access operand bits of the Vulkan memory model:
/// MakePointerAvailable, MakePointerVisible, NonPrivatePointer.
const ACCESS_VULKAN_ONLY: u32 = 0x8 | 0x10 | 0x20;
/// Memory-semantics bits of the Vulkan memory model: OutputMemory,
/// MakeAvailable, MakeVisible, Volatile.
const SEMANTICS_VULKAN_ONLY: u32 = 0x1000 | 0x2000 | 0x4000 | 0x8000;
const SCOPE_QUEUE_FAMILY: u32 = 5;

/// One instruction: opcode and operand words (without the first word).
fn instructions(words: &[u32]) -> Result<Vec<(u16, &[u32])>> {
    ensure!(
        words.len() >= 5 && words[0] == 0x0723_0203,
        "not a SPIR-V module"
    );
    let mut out = vec![];
    let mut i = 5;
    while i < words.len() {
        let count = (words[i] >> 16) as usize;
        ensure!(
            count >= 1 && i + count <= words.len(),
            "SPIR-V instruction at word {i} runs past the module"
        );
        out.push(((words[i] & 0xffff) as u16, &words[i + 1..i + count]));
        i += count;
    }
    Ok(out)
}

/// A literal string operand (UTF-8, nul-terminated, packed little-endian).
fn literal_string(operands: &[u32]) -> String {
    let bytes: Vec<u8> = operands.iter().flat_map(|w| w.to_le_bytes()).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Whether an instruction is the capability or the extension of the Vulkan
/// memory model.
fn enables_vulkan_model(op: u16, operands: &[u32]) -> bool {
    match op {
        OP_CAPABILITY => operands.first() == Some(&CAPABILITY_VULKAN_MEMORY_MODEL),
        OP_EXTENSION => literal_string(operands) == EXTENSION_VULKAN_MEMORY_MODEL,
        _ => false,
    }
}

/// `words` with the Vulkan memory model declared as GLSL450: the
/// `VulkanMemoryModel` capability and the `SPV_KHR_vulkan_memory_model`
/// extension removed, `OpMemoryModel` set to GLSL450; every other word as it
/// was. A module already under GLSL450 comes back unchanged. An error names
/// the first instruction whose meaning the Vulkan memory model defines.
pub(crate) fn glsl450_memory_model(words: &[u32]) -> Result<Vec<u32>> {
    let insts = instructions(words)?;
    let model = insts
        .iter()
        .find(|(op, _)| *op == OP_MEMORY_MODEL)
        .and_then(|(_, w)| w.get(1).copied())
        .ok_or_else(|| anyhow!("no OpMemoryModel"))?;
    match model {
        MEMORY_MODEL_GLSL450 => return Ok(words.to_vec()),
        MEMORY_MODEL_VULKAN => {}
        other => bail!("memory model {other} is neither GLSL450 nor Vulkan"),
    }
    // Scopes and memory semantics are ids of constants.
    let constants: HashMap<u32, u32> = insts
        .iter()
        .filter(|(op, w)| *op == OP_CONSTANT && w.len() == 3)
        .map(|(_, w)| (w[1], w[2]))
        .collect();
    let constant = |id: u32, what: &str| {
        constants
            .get(&id)
            .copied()
            .ok_or_else(|| anyhow!("{what} %{id} is not a 32-bit constant"))
    };
    // Where an instruction's memory-access mask is, if it has one.
    let access_mask = |op: u16, w: &[u32]| -> Option<u32> {
        let at = match op {
            OP_LOAD => 3,       // result type, result, pointer, [mask]
            OP_STORE => 2,      // pointer, object, [mask]
            OP_COOP_LOAD => 5,  // result type, result, pointer, layout, [stride], [mask]
            OP_COOP_STORE => 4, // pointer, object, layout, [stride], [mask]
            _ => return None,
        };
        w.get(at).copied()
    };
    let mut out = words[..5].to_vec();
    for (op, w) in &insts {
        let name = || format!("opcode {op}");
        if OP_ATOMICS.iter().any(|&(a, b)| (a..=b).contains(op))
            || matches!(*op, OP_COPY_MEMORY | OP_COPY_MEMORY_SIZED)
        {
            bail!(
                "{}: atomics and memory copies are not rewritten to the GLSL450 memory model",
                name()
            );
        }
        if let Some(mask) = access_mask(*op, w) {
            ensure!(
                mask & ACCESS_VULKAN_ONLY == 0,
                "{}: memory access {mask:#x} uses the Vulkan memory model",
                name()
            );
        }
        if let Some(ids) = match *op {
            OP_CONTROL_BARRIER => w.get(..3).map(|s| (&s[..2], s[2])),
            OP_MEMORY_BARRIER => w.get(..2).map(|s| (&s[..1], s[1])),
            _ => None,
        } {
            let (scopes, semantics) = ids;
            for &s in scopes {
                let scope = constant(s, "barrier scope").with_context(name)?;
                ensure!(
                    scope != SCOPE_QUEUE_FAMILY,
                    "{}: the queue-family scope needs the Vulkan memory model",
                    name()
                );
            }
            let sem = constant(semantics, "barrier semantics").with_context(name)?;
            ensure!(
                sem & SEMANTICS_VULKAN_ONLY == 0,
                "{}: memory semantics {sem:#x} use the Vulkan memory model",
                name()
            );
        }
        if enables_vulkan_model(*op, w) {
            continue;
        }
        out.push(((w.len() as u32 + 1) << 16) | *op as u32);
        if *op == OP_MEMORY_MODEL {
            ensure!(w.len() == 2, "OpMemoryModel with {} operands", w.len());
            out.extend([w[0], MEMORY_MODEL_GLSL450]);
        } else {
            out.extend_from_slice(w);
        }
    }
    Ok(out)
}

/// What naga may let a kernel use on a device with `features`, by wgpu's
/// own map (f16, subgroup operations, cooperative matrices, ... where the
/// device has them), as wgpu checks the modules it writes: a driver handed
/// SPIR-V that needs what it lacks may fail in any way, even crash. Of the
/// downlevel flags, the one compute kernels can need, SHADER_F16_IN_F32
/// (`unpack2x16float` and its kin), wgpu sets on every Vulkan device, and
/// this path is Vulkan's only.
fn naga_capabilities(features: wgpu::Features) -> naga::valid::Capabilities {
    let downlevel = wgpu::DownlevelFlags::SHADER_F16_IN_F32;
    wgpu_naga_bridge::features_to_naga_capabilities(features, downlevel)
}

/// A kernel's SPIR-V as naga writes it for one entry point, with its
/// override constants applied, and the options wgpu's Vulkan backend uses:
/// workgroup memory not zeroed, as sieve's pipelines ask; loop counters
/// where `loop_counters`; bounds checks that clamp every index. wgpu leaves
/// buffer indices unclamped where the device has robust buffer access 2
/// (out-of-bounds reads give zero there), which sieve cannot see through
/// wgpu's API, so it clamps them too: safe everywhere, a little arithmetic
/// per load (on lavapipe, where it is CPU work, the quantized golden tests
/// took 203 s instead of 100 with every kernel written this way). Also the
/// entry point's workgroup size. `file` names the kernel in errors; a
/// kernel that needs a feature the device lacks is one.
pub(crate) fn kernel_spirv(
    src: &str,
    file: &str,
    entry: &str,
    constants: &[(&str, f64)],
    loop_counters: bool,
    features: wgpu::Features,
) -> Result<(Vec<u32>, [u32; 3])> {
    use naga::back::spv;
    let parsed = crate::shaders::validated_module(src, file, naga_capabilities(features))?;
    // wgpu numbers a layout's bindings 0, 1, 2, ... in the order of their
    // WGSL numbers (`Gpu::layout_for` declares every one the kernel does),
    // and tells naga so; a module wgpu does not write must say the same.
    let mut bindings: Vec<u32> = parsed
        .0
        .global_variables
        .iter()
        .filter_map(|(_, v)| v.binding.as_ref())
        .map(|b| {
            ensure!(b.group == 0, "{file}: binding in group {}", b.group);
            Ok(b.binding)
        })
        .collect::<Result<_>>()?;
    bindings.sort_unstable();
    let binding_map = bindings
        .iter()
        .enumerate()
        .map(|(i, &binding)| {
            let info = spv::BindingInfo {
                descriptor_set: 0,
                binding: i as u32,
                binding_array_size: None,
            };
            (naga::ResourceBinding { group: 0, binding }, info)
        })
        .collect();
    let stage = naga::ShaderStage::Compute;
    let (module, info) = crate::shaders::entry_module(&parsed, file, entry, constants)?;
    let workgroup_size = module
        .entry_points
        .iter()
        .find(|e| e.name == entry)
        .map(|e| e.workgroup_size)
        .expect("entry_module checks it");
    let policy = naga::proc::BoundsCheckPolicy::Restrict;
    let options = spv::Options {
        // SPIR-V 1.5 (Vulkan 1.2), as llama.cpp builds its cooperative-matrix
        // shaders (wgpu picks by the device's Vulkan version, which its API
        // does not show). wgpu offers cooperative matrices where the device
        // has the Vulkan memory model, core in 1.2; a Vulkan 1.1 device with
        // it as an extension could refuse this SPIR-V, and would need
        // `SIEVE_SPIRV=wgpu`. (`all`, for tests, on such a device too.)
        lang_version: (1, 5),
        flags: spv::WriterFlags::empty(),
        fake_missing_bindings: false,
        binding_map,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: policy,
            buffer: policy,
            image_load: policy,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: loop_counters,
        use_storage_input_output_16: false,
        ..Default::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: stage,
        entry_point: entry.to_string(),
    };
    let words = spv::write_vec(&module, &info, &options, Some(&pipeline))
        .map_err(|e| anyhow!("{file}: SPIR-V: {e}"))?;
    Ok((words, workgroup_size))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shaders;

    /// The SPIR-V naga writes for every cooperative-matrix kernel, entry
    /// point, weight or cache format and tile width: (name, words).
    fn coop_modules(rewrite: bool) -> Vec<(String, Vec<u32>)> {
        let out = modules(true, rewrite);
        assert!(out.len() >= 10, "expected every cooperative kernel");
        out
    }

    /// As [`coop_modules`], for every kernel unless `coop_only`.
    fn modules(coop_only: bool, rewrite: bool) -> Vec<(String, Vec<u32>)> {
        let mut out = vec![];
        for s in shaders::all() {
            if coop_only && !shaders::uses_cooperative_matrices(s) {
                continue;
            }
            let formats = shaders::formats(s);
            let entries: Vec<String> = shaders::parse(&shaders::source(
                s,
                formats[0],
                shaders::WeightStore::Buffer,
            ))
            .unwrap()
            .entry_points
            .iter()
            .map(|e| e.name.clone())
            .collect();
            assert!(!entries.is_empty(), "{}: no entry point found", s.file);
            let stores = shaders::stores(s);
            for (f, store) in formats
                .iter()
                .flat_map(|&f| stores.iter().map(move |&st| (f, st)))
            {
                let src = shaders::source(s, f, store);
                for entry in &entries {
                    let wides: &[f64] = if src.contains("override WIDE") {
                        &[1.0, 2.0]
                    } else {
                        &[]
                    };
                    let mut sets: Vec<Vec<(&str, f64)>> = vec![vec![]];
                    sets.extend(wides.iter().map(|&w| vec![("WIDE", w)]));
                    // With and without wgpu's loop counters (`SIEVE_LOOP_BOUNDING`).
                    let counters: &[bool] = if coop_only { &[true] } else { &[true, false] };
                    for (constants, &counted) in sets
                        .iter()
                        .flat_map(|c| counters.iter().map(move |b| (c, b)))
                    {
                        let name = format!(
                            "{} {f:?} {store:?} {entry} {constants:?} counters {counted}",
                            s.file
                        );
                        let features = wgpu::Features::all();
                        let (mut words, _) =
                            kernel_spirv(&src, s.file, entry, constants, counted, features)
                                .unwrap();
                        if rewrite {
                            words = glsl450_memory_model(&words).unwrap();
                        }
                        out.push((name, words));
                    }
                }
            }
        }
        out
    }

    fn has_vulkan_model(words: &[u32]) -> bool {
        instructions(words).unwrap().iter().any(|(op, w)| {
            enables_vulkan_model(*op, w) || (*op == OP_MEMORY_MODEL && w[1] == MEMORY_MODEL_VULKAN)
        })
    }

    /// What the rewrite is for: naga declares the Vulkan memory model in
    /// every cooperative kernel (if a later naga stops doing so, this fails
    /// and the rewrite can go), and the rewrite removes exactly that: two
    /// instructions fewer, one word changed, every other instruction as it
    /// was, the cooperative-matrix instructions and barriers included.
    #[test]
    fn the_rewrite_removes_the_vulkan_memory_model_and_nothing_else() {
        for (name, words) in coop_modules(false) {
            assert!(
                has_vulkan_model(&words),
                "{name}: naga no longer declares it"
            );
            let out = glsl450_memory_model(&words).unwrap();
            assert!(!has_vulkan_model(&out), "{name}");
            let (before, after) = (instructions(&words).unwrap(), instructions(&out).unwrap());
            assert_eq!(after.len() + 2, before.len(), "{name}");
            let kept: Vec<_> = before
                .iter()
                .filter(|(op, w)| !enables_vulkan_model(*op, w))
                .collect();
            let mut changed = 0;
            for (a, b) in kept.iter().zip(&after) {
                if a != &b {
                    assert_eq!((a.0, b.0), (OP_MEMORY_MODEL, OP_MEMORY_MODEL), "{name}");
                    assert_eq!(b.1, &[a.1[0], MEMORY_MODEL_GLSL450], "{name}");
                    changed += 1;
                }
            }
            assert_eq!(changed, 1, "{name}");
            assert!(
                after.iter().any(|(op, _)| *op == OP_COOP_LOAD),
                "{name}: no cooperative load"
            );
            // Rewriting again changes nothing.
            assert_eq!(glsl450_memory_model(&out).unwrap(), out, "{name}");
            assert_eq!(out[..5], words[..5], "{name}: header");
        }
    }

    /// What only the Vulkan memory model defines is refused, never dropped:
    /// a load marked non-private, barrier semantics that make memory
    /// available, the queue-family scope.
    #[test]
    fn the_rewrite_refuses_what_only_the_vulkan_model_defines() {
        let (_, words) = coop_modules(false).swap_remove(0);
        // Each instruction's first word, by opcode.
        let starts = |words: &[u32], want: u16| -> Vec<usize> {
            let mut i = 5;
            let mut out = vec![];
            while i < words.len() {
                if (words[i] & 0xffff) as u16 == want {
                    out.push(i);
                }
                i += (words[i] >> 16) as usize;
            }
            out
        };
        // A load given a mask of NonPrivatePointer (one word more).
        let at = starts(&words, OP_LOAD)[0];
        let count = (words[at] >> 16) as usize;
        assert_eq!(count, 4, "the first load has no mask");
        let mut nonprivate = words.clone();
        nonprivate[at] += 1 << 16;
        nonprivate.insert(at + count, 0x20);
        let e = glsl450_memory_model(&nonprivate).unwrap_err();
        assert!(format!("{e:#}").contains("memory access 0x20"), "{e:#}");
        // The first barrier's semantics constant given MakeAvailable.
        let barrier = starts(&words, OP_CONTROL_BARRIER)[0];
        let semantics_id = words[barrier + 3];
        let mut available = words.clone();
        for c in starts(&words, OP_CONSTANT) {
            if available[c + 2] == semantics_id {
                available[c + 3] |= 0x2000;
            }
        }
        let e = glsl450_memory_model(&available).unwrap_err();
        assert!(format!("{e:#}").contains("memory semantics"), "{e:#}");
        // Its execution scope made the queue family's.
        let scope_id = words[barrier + 1];
        let mut queue = words.clone();
        for c in starts(&words, OP_CONSTANT) {
            if queue[c + 2] == scope_id {
                queue[c + 3] = SCOPE_QUEUE_FAMILY;
            }
        }
        assert!(glsl450_memory_model(&queue).is_err());
        // Not SPIR-V, or cut short.
        assert!(glsl450_memory_model(&[1, 2, 3]).is_err());
        // (The first instruction, a capability, is two words.)
        assert_eq!(words[5] >> 16, 2);
        assert!(glsl450_memory_model(&words[..6]).is_err());
    }

    /// SPIRV-Tools' validator accepts every kernel as sieve writes it, the
    /// rewritten cooperative ones included, for Vulkan 1.2.
    /// It needs a spirv-val that knows SPV_KHR_cooperative_matrix
    /// (SPIRV-Tools 2023.4 or later; Debian 12's 2023.1 does not), named by
    /// `SIEVE_SPIRV_VAL`: `SIEVE_SPIRV_VAL=/path/to/spirv-val cargo test
    /// --release --lib spirv -- --ignored`.
    #[test]
    #[ignore = "needs a recent spirv-val named by SIEVE_SPIRV_VAL"]
    fn spirv_val_accepts_every_kernel_as_sieve_writes_it() {
        let val = std::env::var("SIEVE_SPIRV_VAL").expect("SIEVE_SPIRV_VAL: path of spirv-val");
        let dir = std::env::temp_dir().join(format!("sieve-spirv-val-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let modules = modules(false, true);
        for (i, (name, words)) in modules.iter().enumerate() {
            let path = dir.join(format!("{i}.spv"));
            std::fs::write(&path, bytemuck::cast_slice::<u32, u8>(words)).unwrap();
            let out = std::process::Command::new(&val)
                .args(["--target-env", "vulkan1.2"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
        eprintln!("spirv-val accepted {} modules", modules.len());
    }
}
