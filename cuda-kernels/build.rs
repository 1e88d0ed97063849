//! Finds the kernels (every `extern "C" __global__ void NAME(` in `kernels/*.cu`), so that the list
//! the Rust side launches from, the simulator's registry and the sources are one thing; with the
//! `sim` feature, compiles the sources with the simulator.

use std::fmt::Write as _;
use std::path::PathBuf;

fn kernel_names(source: &str) -> Vec<String> {
    const MARK: &str = "extern \"C\" __global__ void ";
    source
        .match_indices(MARK)
        .filter_map(|(at, _)| {
            let rest = &source[at + MARK.len()..];
            rest.find('(').map(|end| rest[..end].trim().to_owned())
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let dir = manifest.join("kernels");
    println!("cargo:rerun-if-changed={}", dir.display());
    println!("cargo:rerun-if-changed={}", manifest.join("sim").display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();

    let mut modules = String::from("pub const MODULES: &[Module] = &[\n");
    let mut sim_sources = String::new();
    let mut sim_registry = String::new();
    for file in &files {
        let source = std::fs::read_to_string(file)?;
        let names = kernel_names(&source);
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or("kernel file names are UTF-8")?;
        let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
        writeln!(
            modules,
            "    Module {{ name: {stem:?}, source: include_str!({:?}), kernels: &[{}] }},",
            file.display().to_string(),
            quoted.join(", ")
        )?;
        writeln!(sim_sources, "#include \"{}\"", file.display())?;
        for name in &names {
            writeln!(sim_registry, "MMGATE_SIM_KERNEL({name})")?;
        }
    }
    modules.push_str("];\n");
    std::fs::write(out.join("modules.rs"), &modules)?;

    if std::env::var_os("CARGO_FEATURE_SIM").is_some() {
        std::fs::write(out.join("mmgate_sim_kernels.inc"), &sim_sources)?;
        std::fs::write(out.join("mmgate_sim_registry.inc"), &sim_registry)?;
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file(manifest.join("sim/sim.cpp"))
            .include(manifest.join("sim"))
            .include(&dir)
            .include(&out)
            .opt_level(2)
            .warnings(true)
            .flag_if_supported("-Wno-unused-parameter")
            .compile("mmgate_cuda_sim");
        println!("cargo:rustc-link-lib=stdc++");
    }
    Ok(())
}
