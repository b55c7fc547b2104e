//! One module per subcommand; `common` holds what several share (loading machines,
//! models and plans with errors that name the input).

pub mod common;
pub mod devices;
pub mod exec;
pub mod exec_options;
pub mod exec_print;
pub mod plan;
pub mod progress;
pub mod run_report;
pub mod serve;
pub mod sim;
pub mod testdata;
pub mod tune;
