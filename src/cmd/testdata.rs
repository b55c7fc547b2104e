//! `mold testdata NAME DIR`: random-weight checkpoints and whole weights directories
//! with real tensor names, for tests and benchmarks (FLUX's from
//! [`mold_exec::model::flux::testdata`] and [`mold_pipeline::flux::testdata`], Qwen-Image's
//! from [`mold_exec::model::qwen::testdata`] and [`mold_pipeline::qwen::testdata`]).

use super::progress::{say, OutputArgs, Reporter};
use anyhow::{bail, Context, Result};
use mold_exec::FluxConfig;
use mold_plan::ByteSize;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A FLUX-family model: flux-tiny, flux-dev or flux-schnell (the transformer); or
    /// flux-tiny-pipeline: a whole tiny weights directory (T5, CLIP, VAE, tokenizers,
    /// transformer) for `mold exec --prompt`; flux-tiny-hf, flux-dev-hf, flux-schnell-hf:
    /// the same in the Hugging Face repository's layout (BFL and diffusers transformers);
    /// qwen-image, qwen-image-tiny: the transformer as the published repository's
    /// `transformer/` folder (shards, index, diffusers' config.json);
    /// qwen-image-tiny-pipeline, qwen-image-pipeline: the whole Qwen-Image repository
    /// (transformer, text encoder, tokenizer, VAE, scheduler) for `mold exec --prompt`.
    pub name: String,
    /// Directory to write into (created if missing).
    pub dir: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// f32 or bf16 (default: f32 for flux-tiny, bf16 otherwise).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Split into shards of at most this size, with an index.json (e.g. 5GB).
    #[arg(long)]
    pub shard_size: Option<ByteSize>,
    /// Write into DIR even when it holds files: those of the same names are replaced (a
    /// symlink, such as a Hugging Face cache snapshot's, is replaced by a file of its own
    /// and its target left untouched). Without it a directory that holds anything is
    /// refused.
    #[arg(long, alias = "overwrite")]
    pub force: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

fn flux_config(id: &str) -> Result<FluxConfig> {
    FluxConfig::by_name(id).with_context(|| {
        format!("model `{id}`: testdata writes flux-dev, flux-schnell, flux-tiny, qwen-image and qwen-image-tiny transformers (and the pipelines and -hf snapshots of `mold testdata --help`)")
    })
}

/// Symlinks to files found in a `mold testdata` directory before writing, each with its
/// target ([`mold_files::check_dir`]): a file written over one replaces the link, and
/// the report says so.
type Links = [(PathBuf, PathBuf)];

pub fn run(a: Args) -> Result<i32> {
    // A directory that holds anything is refused without --force (nothing of the user's
    // is replaced unasked); with it, every file is written through a temporary file
    // renamed over its path, so a symlink there (a hub cache snapshot's link into its
    // blobs) is replaced and its target never written.
    let links = mold_files::check_dir(&a.dir, "--force", a.force)?;
    if let Some(model) = a.name.strip_suffix("-hf") {
        return testdata_hf(&a, model, &links);
    }
    if a.name == "flux-tiny-pipeline" {
        return testdata_pipeline(a, &links);
    }
    if matches!(
        a.name.as_str(),
        "qwen-image-tiny-pipeline" | "qwen-image-pipeline"
    ) {
        return testdata_qwen_pipeline(&a, &links);
    }
    if let Some(model) = a.name.strip_suffix("-pipeline") {
        return testdata_full_pipeline(&a, model, &links);
    }
    if let Some(cfg) = mold_exec::QwenConfig::by_name(&a.name) {
        return testdata_qwen(&a, &cfg, &links);
    }
    let cfg = flux_config(&a.name)?;
    let dtype = match a.dtype.as_deref() {
        None if a.name == "flux-tiny" => mold_exec::DType::F32,
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    std::fs::create_dir_all(&a.dir)
        .with_context(|| format!("cannot create {}", a.dir.display()))?;
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let path = rep.observe_writes(|| -> Result<PathBuf> {
        Ok(match a.shard_size {
            Some(s) => mold_exec::write_testdata_sharded(&cfg, &a.dir, a.seed, dtype, s.0)?,
            None => mold_exec::write_testdata(&cfg, &a.dir, a.seed, dtype)?,
        })
    })?;
    rep.event(wrote_event(&path, &links));
    rep.result(
        format_args!(
            "wrote {} ({} parameters, {dtype:?}, seed {}) in {:.1} s",
            wrote(&path, &links),
            cfg.param_count(),
            a.seed,
            t.elapsed().as_secs_f64()
        ),
        json!({
            "event": "done",
            "model": a.name,
            "parameters": cfg.param_count(),
            "dtype": format!("{dtype:?}"),
            "seed": a.seed,
            "seconds": t.elapsed().as_secs_f64(),
        }),
    );
    Ok(0)
}

/// `mold testdata qwen-image DIR` (and qwen-image-tiny): the transformer in the published
/// repository's `transformer/` layout, in shards of `--shard-size` (default 5 GB, as
/// published).
fn testdata_qwen(a: &Args, cfg: &mold_exec::QwenConfig, links: &Links) -> Result<i32> {
    let dtype = match a.dtype.as_deref() {
        None if a.name.ends_with("-tiny") => mold_exec::DType::F32,
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    let shard = a.shard_size.map(|s| s.0).unwrap_or(5_000_000_000);
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep.observe_writes(|| -> Result<Vec<PathBuf>> {
        mold_exec::model::qwen::testdata::write_testdata(cfg, &a.dir, a.seed, dtype, shard)
            .with_context(|| format!("cannot write {} into {}", a.name, a.dir.display()))
    })?;
    report_testdata(
        &rep,
        a,
        &files,
        links,
        &format!("{dtype:?}"),
        Some(cfg.param_count()),
        t,
        format_args!("{} transformer, random weights ({} parameters, {dtype:?}, seed {}): `mold exec PLAN --weights {}`", a.name, cfg.param_count(), a.seed, a.dir.display()),
    );
    Ok(0)
}

/// `mold testdata qwen-image-tiny-pipeline DIR` (f32) and `qwen-image-pipeline DIR`
/// (bf16 unless --dtype f32): the whole Qwen-Image repository layout, random weights.
fn testdata_qwen_pipeline(a: &Args, links: &Links) -> Result<i32> {
    let tiny = a.name == "qwen-image-tiny-pipeline";
    let dtype = match (a.dtype.as_deref(), tiny) {
        (None | Some("f32"), true) => mold_exec::DType::F32,
        (Some(o), true) => {
            bail!("--dtype {o}: qwen-image-tiny-pipeline is written in f32: drop --dtype")
        }
        (None | Some("bf16"), false) => mold_exec::DType::BF16,
        (Some("f32"), false) => mold_exec::DType::F32,
        (Some(o), false) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    if a.shard_size.is_some() {
        bail!("{}: the transformer and text encoder are written in 5 GB shards as published: drop --shard-size", a.name);
    }
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep
        .observe_writes(|| {
            if tiny {
                mold_pipeline::qwen::testdata::write_tiny_pipeline(&a.dir, a.seed)
            } else {
                mold_pipeline::qwen::testdata::write_full_pipeline(&a.dir, a.seed, dtype)
            }
        })
        .with_context(|| format!("cannot write {} into {}", a.name, a.dir.display()))?;
    report_testdata(
        &rep,
        a,
        &files,
        links,
        &format!("{dtype:?}"),
        None,
        t,
        format_args!("{}, random weights ({dtype:?}, seed {}): `mold exec PLAN --weights {} --prompt \"...\" --negative-prompt \"...\" --cfg 4`", a.name, a.seed, a.dir.display()),
    );
    Ok(0)
}

/// `mold testdata flux-dev-hf DIR` (and flux-schnell-hf, flux-tiny-hf): a random snapshot
/// in the layout of the Hugging Face repository, both transformer formats.
fn testdata_hf(a: &Args, model: &str, links: &Links) -> Result<i32> {
    let which = mold_pipeline::flux::testdata::hf::HfModel::by_name(model).with_context(|| {
        format!(
            "{}: Hugging Face snapshots are flux-tiny-hf, flux-dev-hf or flux-schnell-hf",
            a.name
        )
    })?;
    let dtype = match a.dtype.as_deref() {
        None if model == "flux-tiny" => mold_exec::DType::F32,
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    if a.shard_size.is_some() {
        bail!(
            "{}: files are sharded as the published repository's: drop --shard-size",
            a.name
        );
    }
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep
        .observe_writes(|| {
            mold_pipeline::flux::testdata::hf::write_hf_snapshot(&a.dir, which, a.seed, dtype)
        })
        .with_context(|| format!("cannot write the {model} snapshot into {}", a.dir.display()))?;
    report_testdata(
        &rep,
        a,
        &files,
        links,
        &format!("{dtype:?}"),
        None,
        t,
        format_args!(
            "{model} Hugging Face-layout snapshot, random weights ({dtype:?}, seed {}): `mold exec PLAN --weights {} --prompt \"...\"` (remove {} to run the diffusers-format transformer/)",
            a.seed,
            a.dir.display(),
            if model == "flux-schnell" { "flux1-schnell.safetensors" } else { "flux1-dev.safetensors" }
        ),
    );
    Ok(0)
}

/// `mold testdata flux-dev-pipeline DIR`: a full-size pipeline with random weights.
fn testdata_full_pipeline(a: &Args, model: &str, links: &Links) -> Result<i32> {
    let dtype = match a.dtype.as_deref() {
        None | Some("bf16") => mold_exec::DType::BF16,
        Some("f32") => mold_exec::DType::F32,
        Some(o) => bail!("--dtype {o}: testdata writes f32 or bf16"),
    };
    if a.shard_size.is_some() {
        bail!("{}: the transformer is written in 5 GB shards, the others one file each: drop --shard-size", a.name);
    }
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep
        .observe_writes(|| {
            mold_pipeline::flux::testdata::write_full_pipeline(&a.dir, model, a.seed, dtype)
        })
        .with_context(|| format!("cannot write the {model} pipeline into {}", a.dir.display()))?;
    report_testdata(
        &rep,
        a,
        &files,
        links,
        &format!("{dtype:?}"),
        None,
        t,
        format_args!("{model} pipeline, random weights ({dtype:?}, seed {}): `mold exec PLAN --weights {} --prompt \"...\"`", a.seed, a.dir.display()),
    );
    Ok(0)
}

/// `mold testdata flux-tiny-pipeline DIR`: every component of a tiny FLUX pipeline.
fn testdata_pipeline(a: Args, links: &Links) -> Result<i32> {
    if a.dtype.as_deref().is_some_and(|d| d != "f32") || a.shard_size.is_some() {
        bail!("flux-tiny-pipeline is written in f32, one file per component: drop --dtype and --shard-size");
    }
    let rep = Reporter::new(a.output);
    let t = Instant::now();
    let files = rep
        .observe_writes(|| mold_pipeline::flux::testdata::write_tiny_pipeline(&a.dir, a.seed))
        .with_context(|| format!("cannot write the tiny pipeline into {}", a.dir.display()))?;
    report_testdata(
        &rep,
        &a,
        &files,
        links,
        "F32",
        None,
        t,
        format_args!("tiny FLUX pipeline (seed {}): plan flux-tiny, then `mold exec PLAN --weights {} --prompt \"...\"`", a.seed, a.dir.display()),
    );
    Ok(0)
}

/// `path` as the report names a file written: with the symlink it replaced, if any.
fn wrote(path: &Path, links: &Links) -> String {
    match links.iter().find(|(l, _)| l == path) {
        Some((_, target)) => format!(
            "{} (replaced a symlink to {}, which is untouched)",
            path.display(),
            target.display()
        ),
        None => path.display().to_string(),
    }
}

/// The JSON event of a file written (`replaced_symlink`: the target of the link it
/// replaced).
fn wrote_event(path: &Path, links: &Links) -> serde_json::Value {
    let mut e = json!({"event": "wrote", "path": path.display().to_string()});
    if let Some((_, target)) = links.iter().find(|(l, _)| l == path) {
        e["replaced_symlink"] = json!(target.display().to_string());
    }
    e
}

/// Prints what a `mold testdata` command wrote (a line and a JSON event per file, with
/// the symlink each replaced) and its one-line result, `summary` followed by how long it
/// took.
#[allow(clippy::too_many_arguments)]
fn report_testdata(
    rep: &Reporter,
    a: &Args,
    files: &[PathBuf],
    links: &Links,
    dtype: &str,
    parameters: Option<u64>,
    t: Instant,
    summary: std::fmt::Arguments,
) {
    for f in files {
        say!(rep, "wrote {}", wrote(f, links));
        rep.event(wrote_event(f, links));
    }
    let secs = t.elapsed().as_secs_f64();
    let mut done = json!({
        "event": "done",
        "model": a.name,
        "dtype": dtype,
        "seed": a.seed,
        "seconds": secs,
    });
    if let Some(n) = parameters {
        done["parameters"] = json!(n);
    }
    rep.result(format_args!("{summary} ({secs:.1} s)"), done);
}
