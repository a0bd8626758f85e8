//! The balancer's own HTTP/1.1 server, for every listener (the balancer, the admin
//! API, `mock-engine`): request heads read as pure functions ([`request`]), response
//! heads written the same way ([`response`]), and the connection that drives them
//! ([`conn`]). A connection that opens with the HTTP/2 preface is handed back to the
//! listener, which gives it to hyper.
//!
//! Why not hyper's HTTP/1.1 server: at a kilobyte a request, hyper's connection task
//! (its dispatcher, its body channel, its per-request bookkeeping) was a third of the
//! balancer's instructions, and the gap to HAProxy (docs/performance.md). This one
//! calls the handler from the connection's own task, hands a body that came with
//! its head over whole, and writes a response head and a whole body in one write.

pub mod conn;
pub mod request;
pub mod response;

#[cfg(test)]
mod tests;
