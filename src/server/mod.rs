//! The process and control plane: the control plane's state and the table rebuilds
//! ([`control`]), the HTTP listener and its limits ([`listener`]), `prefixlb serve`
//! ([`serve`]) with its serving lanes ([`lanes`]) and reload triggers ([`reload`]),
//! the admin API ([`admin`]) with its status page ([`status`]), active health checks
//! ([`health`]), and HTTPS on the client port ([`tls`]).

pub mod admin;
pub mod control;
pub mod cpus;
pub mod h1;
pub mod head_timer;
pub mod health;
pub mod lanes;
pub mod listener;
pub mod reload;
pub mod serve;
pub mod status;
pub mod tls;
pub mod window_watch;
pub mod yielding;
