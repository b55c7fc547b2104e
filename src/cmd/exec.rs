use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct Args {
    pub plan: std::path::PathBuf,
}

#[derive(clap::Args, Debug)]
pub struct TestdataArgs {
    pub name: String,
    pub dir: std::path::PathBuf,
}

pub fn run(_a: Args) -> Result<i32> {
    anyhow::bail!("mold exec: under construction")
}

pub fn testdata(_a: TestdataArgs) -> Result<i32> {
    anyhow::bail!("mold testdata: under construction")
}
