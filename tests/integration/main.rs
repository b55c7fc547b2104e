//! mold's one integration test binary (as in ripgrep): the CLI end to end, the shipped
//! plans, and the parsers under fuzzing.

mod cli_calibrate;
mod cli_devices;
mod cli_exec;
mod cli_files;
mod cli_hf;
mod cli_launchers;
mod cli_multiprocess;
mod cli_pipeline;
mod cli_plan;
mod cli_progress;
mod cli_qwen;
mod cli_qwen_pipeline;
mod cli_report;
mod cli_serve;
mod cli_sim;
mod cli_tune;
mod parsers;
mod parsers_env;
mod parsers_lora;
mod plans;
mod util;
