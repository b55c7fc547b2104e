use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct Args {
    pub plan: Option<std::path::PathBuf>,
}

pub fn run(_a: Args) -> Result<i32> {
    anyhow::bail!("mold sim: under construction")
}
