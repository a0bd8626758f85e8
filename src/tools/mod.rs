//! The tools around the balancer, behind the cargo feature `tools` (on by default):
//! the engine model shared by `mock-engine` and the simulator ([`engine_model`]), the
//! workloads ([`workload`]), the fleet simulator ([`sim`]), the HTTP load generator
//! ([`bench`]), the one-command [`demo`], and the engine emulator ([`mock_engine`]).

pub mod bench;
pub mod demo;
pub mod engine_model;
pub mod mock_engine;
pub mod sim;
pub mod workload;
