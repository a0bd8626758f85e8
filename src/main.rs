//! The `prefixlb` command line: one function per subcommand. `serve`, `check` and
//! `route` are the balancer's; `simulate`, `bench`, `demo` and `mock-engine` come with
//! the `tools` feature (on by default).

use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};

use prefixlb::config::{unix_now, Config};
use prefixlb::routing::table::{Registry, Table};

/// mimalloc rather than glibc's malloc: a proxied request makes about 20 small
/// allocations, and mimalloc's thread-local pages serve them with less CPU
/// (docs/performance.md, fifth sitting).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turns transparent huge pages off for this process, unless `MIMALLOC_ALLOW_THP` is
/// set (then mimalloc does what it says). Where the kernel has THP `always`, the
/// allocator's 2 MiB-aligned arenas fault in whole huge pages: 1,000 open streams
/// peaked at 73.9 MB resident with THP and 51.9 MB without, idle 19.9 MB against
/// 10.8 MB, at no measurable CPU cost (docs/performance.md). A proxy's heap is small
/// and scattered; huge pages buy it nothing.
///
/// It runs as a constructor ahead of mimalloc's own (priority 101), before anything is
/// allocated: from `main` it would come after the first arena's first huge page.
#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array.00100"]
static NO_TRANSPARENT_HUGE_PAGES: extern "C" fn() = no_transparent_huge_pages;

#[cfg(target_os = "linux")]
extern "C" fn no_transparent_huge_pages() {
    // SAFETY: getenv reads the environment, which nothing writes this early (no other
    // thread exists); PR_SET_THP_DISABLE takes integers and sets a flag on this
    // process. Neither allocates. A kernel without it (before 3.15) keeps THP.
    unsafe {
        if libc::getenv(c"MIMALLOC_ALLOW_THP".as_ptr()).is_null() {
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
}

#[derive(Parser)]
#[command(
    name = "prefixlb",
    version,
    about = "Prefix-affinity load balancer for LLM inference fleets"
)]
struct Cli {
    /// Log format on stderr. Filter with RUST_LOG (default "info").
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the balancer.
    Serve(ConfigArg),
    /// Validate a config; print pools, nodes and ring stats. Exit 2 on a bad config.
    Check(ConfigArg),
    /// Explain offline how one request would be routed (JSON).
    Route(RouteArgs),
    /// Run beside an engine: heartbeat it into Redis while it is healthy.
    Agent(AgentArgs),
    /// Simulate a fleet in virtual time and compare routing policies.
    #[cfg(feature = "tools")]
    Simulate(tools::SimulateArgs),
    /// Load-test an OpenAI-compatible endpoint with a replayed workload.
    #[cfg(feature = "tools")]
    Bench(tools::BenchArgs),
    /// Start emulated engines and the balancer in this process, drive a multi-turn
    /// workload through real HTTP with round-robin and with prefixlb, print the comparison.
    #[cfg(feature = "tools")]
    Demo,
    /// Run an OpenAI-compatible engine emulator with a prefix-cache latency model.
    #[cfg(feature = "tools")]
    MockEngine(tools::MockEngineArgs),
}

#[derive(Args)]
struct ConfigArg {
    #[arg(long)]
    config: PathBuf,
}

#[derive(Args)]
struct AgentArgs {
    /// `redis://[user:pass@]host:port[/db]` or `rediss://…` (TLS).
    #[arg(long)]
    redis: String,
    /// An environment variable holding the Redis password (instead of the URL's).
    #[arg(long)]
    password_env: Option<String>,
    /// The fleet's key prefix (the balancers' `redis.key_prefix`).
    #[arg(long, default_value = "prefixlb")]
    key_prefix: String,
    /// The engine's base URL, as the balancers reach it, e.g. http://10.0.0.5:8000.
    #[arg(long)]
    backend: String,
    /// The pool the engine serves (a `[[pools]]` name of the balancers' config).
    #[arg(long)]
    pool: String,
    /// The node id (default: the backend's host:port).
    #[arg(long)]
    id: Option<String>,
    #[arg(long, default_value_t = 1)]
    weight: u32,
    /// A model name it serves (repeatable; default: learned from /v1/models).
    #[arg(long = "model")]
    models: Vec<String>,
    /// How often to check the engine and heartbeat.
    #[arg(long, default_value = "2s", value_parser = parse_dur)]
    interval: std::time::Duration,
    /// How long a heartbeat lives.
    #[arg(long, default_value = "6s", value_parser = parse_dur)]
    ttl: std::time::Duration,
    /// Data-parallel ranks the engine runs behind its URL (vLLM --data-parallel-size,
    /// SGLang --dp-size): the balancers make each rank a node, `{id}@{rank}`.
    #[arg(long, default_value_t = 1)]
    data_parallel_size: u32,
}

fn parse_dur(s: &str) -> Result<std::time::Duration, String> {
    prefixlb::config::parse_duration(s)
}

#[derive(Args)]
struct RouteArgs {
    #[arg(long)]
    config: PathBuf,
    /// Request path.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// A request header, `name:value` (repeatable).
    #[arg(long = "header", value_name = "K:V")]
    headers: Vec<String>,
    /// The request body file, or `-` for stdin.
    #[arg(default_value = "-")]
    body: String,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = cli.log_format;
    // `serve` starts its logging once its config (and `[tracing]`) is read.
    if !matches!(cli.command, Command::Serve(_)) {
        let _ = init_logging(format, default_log_level(&cli.command), None);
    }
    let result = match cli.command {
        Command::Serve(a) => serve(a, format),
        Command::Check(a) => check(a),
        Command::Route(a) => route(a),
        Command::Agent(a) => agent(a),
        #[cfg(feature = "tools")]
        Command::Simulate(a) => tools::simulate(a),
        #[cfg(feature = "tools")]
        Command::Bench(a) => tools::bench(a),
        #[cfg(feature = "tools")]
        Command::Demo => tools::demo(),
        #[cfg(feature = "tools")]
        Command::MockEngine(a) => tools::mock_engine(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The demo prints a report; its in-process servers only speak up on trouble.
fn default_log_level(command: &Command) -> &'static str {
    #[cfg(feature = "tools")]
    if matches!(command, Command::Demo) {
        return "warn";
    }
    let _ = command;
    "info"
}

fn serve(a: ConfigArg, format: LogFormat) -> anyhow::Result<ExitCode> {
    let Some(config) = load(&a.config) else {
        return Ok(ExitCode::from(2));
    };
    // With no serving lanes, the shared runtime's workers serve the client port, and
    // are pinned as lanes would be (`server.pin_threads`).
    let pinned = {
        use prefixlb::server::cpus;
        let workers = cpus::shared_workers();
        let cpus = cpus::chosen(config.server.pin_threads, workers, cpus::allowed());
        (config.server.lanes == 0 && !cpus.is_empty()).then_some(cpus)
    };
    let rt = runtime_pinned(pinned.clone().map(prefixlb::server::cpus::Workers::new))?;
    // The trace exporter's batches run on this runtime.
    let exporter = {
        let _entered = rt.enter();
        init_logging(format, "info", config.tracing.as_ref())?
    };
    if let Some(cpus) = pinned {
        tracing::info!(
            ?cpus,
            "serving workers pinned: worker n to the n-th of these CPUs"
        );
    }
    let served = rt.block_on(prefixlb::server::serve::run(
        config,
        a.config,
        prefixlb::server::listener::termination(),
    ));
    // The last spans go out while the runtime still runs.
    if let Some(exporter) = exporter {
        exporter.shutdown();
    }
    served?;
    Ok(ExitCode::SUCCESS)
}

fn agent(a: AgentArgs) -> anyhow::Result<ExitCode> {
    // The balancers check a record's URL the same way, and skip one that fails.
    let backend = prefixlb::config::parse_node_url(a.backend.trim_end_matches('/'))
        .map_err(|why| anyhow::anyhow!("--backend: {why}"))?;
    let Some(authority) = backend.authority().map(|x| x.to_string()) else {
        anyhow::bail!(
            "--backend {:?} needs a host, e.g. http://10.0.0.5:8000",
            a.backend
        );
    };
    if !(1..=1000).contains(&a.weight) || a.ttl < a.interval * 2 {
        anyhow::bail!("--weight must be 1..=1000 and --ttl at least twice --interval");
    }
    let options = prefixlb::fleet::agent::AgentOptions {
        redis: a.redis,
        password_env: a.password_env,
        key_prefix: a.key_prefix,
        backend: a.backend,
        pool: a.pool,
        id: a.id.unwrap_or(authority),
        weight: a.weight,
        models: a.models,
        interval: a.interval,
        ttl: a.ttl,
        data_parallel_size: a.data_parallel_size,
    };
    let stop = prefixlb::server::listener::termination();
    match runtime()?.block_on(prefixlb::fleet::agent::run(options, stop)) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(2))
        }
    }
}

fn check(a: ConfigArg) -> anyhow::Result<ExitCode> {
    let Some(config) = load(&a.config) else {
        return Ok(ExitCode::from(2));
    };
    let found = look_up_names(&config)?;
    emit(check_report(&a.config, config))?;
    emit(names_report(found))?;
    Ok(ExitCode::SUCCESS)
}

type Lookups = Vec<(
    prefixlb::fleet::dns::Name,
    Result<Vec<prefixlb::config::Endpoint>, String>,
)>;

/// What each `discover` name of `config` resolves to from here, now.
fn look_up_names(config: &Config) -> anyhow::Result<Lookups> {
    let names = prefixlb::fleet::dns::names(config);
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let nameservers = &config.discovery.nameservers;
    Ok(runtime.block_on(prefixlb::fleet::dns::look_up_once(nameservers, names)))
}

/// The lookups, shown: never an error (the balancer may run where another DNS answers).
fn names_report(found: Lookups) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for ((_, name), answer) in found {
        let _ = match answer {
            Ok(addresses) => {
                let list: Vec<String> = addresses
                    .iter()
                    .map(prefixlb::fleet::dns::endpoint_text)
                    .collect();
                writeln!(out, "dns {name}: {} now ({})", list.len(), list.join(", "))
            }
            Err(e) => writeln!(
                out,
                "dns {name}: no address from here ({e}); the balancer keeps looking it up"
            ),
        };
    }
    out
}

fn route(a: RouteArgs) -> anyhow::Result<ExitCode> {
    let Some(config) = load(&a.config) else {
        return Ok(ExitCode::from(2));
    };
    // The nodes of `discover` names are those the names have now.
    let mut addresses = prefixlb::fleet::dns::Addresses::new();
    for (name, answer) in look_up_names(&config)? {
        match answer {
            Ok(list) => {
                addresses.insert(name, list);
            }
            Err(e) => eprintln!("dns {}: no address from here ({e})", name.1),
        }
    }
    let (config, _, skipped) = prefixlb::fleet::dns::expand(&config, &addresses);
    for s in skipped {
        eprintln!("{s}");
    }
    let key_header = config.routing.key_header.clone();
    let body = read_body(&a.body)?;
    let mut header_key = None;
    let mut headers = http::HeaderMap::new();
    for h in &a.headers {
        let (k, v) = h
            .split_once(':')
            .with_context(|| format!("--header {h:?} is not name:value"))?;
        if k.trim().eq_ignore_ascii_case(key_header.as_str()) {
            header_key = Some(v.trim().as_bytes().to_vec());
        }
        let name = http::HeaderName::from_bytes(k.trim().as_bytes())
            .with_context(|| format!("--header {h:?}: bad name"))?;
        let value = http::HeaderValue::from_str(v.trim())
            .with_context(|| format!("--header {h:?}: bad value"))?;
        headers.append(name, value);
    }
    let table = Table::build(config, &Registry::default());
    let now = std::time::Instant::now();
    match prefixlb::routing::explain::explain(&table, &a.path, header_key.as_deref(), &body, now) {
        Ok(x) => {
            let x = prefixlb::server::admin::explanation_json(&table, x, &headers);
            emit(format!("{}\n", serde_json::to_string_pretty(&x)?))?;
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(2))
        }
    }
}

/// Writes a command's report to stdout; a reader that went away (`| head`) is not an
/// error.
fn emit(text: impl std::fmt::Display) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match write!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        written => Ok(written?),
    }
}

/// Loads a config, printing `file:line:col: message` on failure.
fn load(path: &Path) -> Option<Config> {
    match Config::load(path) {
        Ok(c) => Some(c),
        Err(e) => {
            eprintln!("{e}");
            None
        }
    }
}

fn check_report(path: &Path, config: Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let r = &config.routing;
    let _ = writeln!(
        out,
        "{}: ok\nrouting: key={} prefix_chars={} vnodes={} max_in_flight={} load_factor={} when_saturated={} max_attempts={}",
        path.display(),
        r.key.as_str(),
        r.prefix_chars,
        r.vnodes,
        r.max_in_flight,
        r.load_factor.map(|c| c.to_string()).unwrap_or_else(|| "none".into()),
        r.when_saturated.as_str(),
        r.max_attempts
    );
    if let Some(https) = &config.server.tls {
        let clients = match https.clients {
            Some(_) => "; client certificates required (tls_client_ca_file)",
            None => "",
        };
        let _ = writeln!(
            out,
            "listen: https://{} ({} certificates in the chain; {}){clients}",
            config.server.listen,
            https.key.cert.len(),
            https.expires.describe(unix_now())
        );
        if config.server.admin_tls {
            let _ = writeln!(
                out,
                "admin: https://{} (the same certificate; no client certificates asked for)",
                config.server.admin_listen
            );
        }
    }
    let tls_nodes = config
        .pools
        .iter()
        .flat_map(|p| &p.nodes)
        .filter(|n| n.url.scheme_str() == Some("https"))
        .count();
    let tls = &config.tls;
    if tls_nodes > 0 || tls.ca_certificates().is_some() || tls.mutual() {
        let roots = match tls.ca_certificates() {
            Some(n) => format!("ca_file ({n} certificates)"),
            None => "the system's roots".into(),
        };
        let mutual = match tls.client_certificate_expires() {
            Some(e) => format!("; client certificate (mTLS), {}", e.describe(unix_now())),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "tls: {tls_nodes} https nodes; trusting {roots}{mutual}"
        );
    }
    let table = Table::build(config, &Registry::default());
    for pool in &table.pools {
        let b = &pool.balancer;
        let own = b.ring().ownership();
        let c = &pool.config;
        let tags: Vec<String> = [
            c.default.then(|| "default".to_string()),
            c.decode_pool
                .as_ref()
                .map(|d| format!("prefill engines; decode engines in {d}")),
            c.decodes_for
                .as_ref()
                .map(|p| format!("decode engines of {p}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        let marks = match tags.is_empty() {
            true => String::new(),
            false => format!(" [{}]", tags.join("; ")),
        };
        let adapters = c.adapters.iter().map(|a| format!("; adapter {a}"));
        let aliases = c
            .aliases
            .iter()
            .map(|(alias, model)| format!("; {alias} = {model}"));
        let aliases: Vec<_> = adapters.chain(aliases).collect();
        let _ = writeln!(
            out,
            "pool {} (models: {}{}){marks}: {} nodes, {} ring points",
            pool.config.name,
            pool.config.models.join(", "),
            aliases.concat(),
            b.ring().len(),
            b.ring().points()
        );
        for (n, share) in b.nodes().iter().zip(own) {
            let bootstrap = n.bootstrap_port().map(|p| format!(", bootstrap port {p}"));
            let _ = writeln!(
                out,
                "  node {:<16} {:<32} weight {:<3} cap {:<4} key share {:5.1}%{}",
                n.id(),
                n.url().to_string(),
                n.weight(),
                n.cap(),
                share * 100.0,
                bootstrap.unwrap_or_default()
            );
        }
        for e in &c.named {
            let _ = writeln!(
                out,
                "  {:<4} {:<16} {:<32} weight {:<3} a node per {} of {}, looked up every {:?}",
                e.discover.as_str(),
                e.id,
                e.url.to_string(),
                e.weight,
                match e.discover {
                    prefixlb::config::Discover::Dns => "address",
                    prefixlb::config::Discover::Srv => "SRV target and port",
                },
                e.name(),
                table.config.discovery.interval
            );
        }
        if c.decodes_for.is_some() && c.max_in_flight.is_none() {
            let _ = writeln!(
                out,
                "  (each decode engine streams at most {} answers at once, routing.max_in_flight: a decode engine batches many, so set decode_max_in_flight near what one runs at once; docs/operating.md, \"Prefill/decode disaggregation\")",
                table.config.routing.max_in_flight
            );
        }
    }
    out
}

fn read_body(arg: &str) -> anyhow::Result<Vec<u8>> {
    if arg == "-" {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading the body from stdin")?;
        Ok(buf)
    } else {
        std::fs::read(arg).with_context(|| format!("reading body file {arg}"))
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    runtime_pinned(None)
}

/// The shared runtime; with `pins`, each worker pinned to a CPU of its own.
fn runtime_pinned(
    pins: Option<prefixlb::server::cpus::Workers>,
) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // A worker's log lines go out in one write when it runs out of work (blocking
        // threads never unpark, so they write each line straight through); a busy
        // stretch starts (`server.yield_after`).
        .on_thread_unpark(|| {
            prefixlb::telemetry::log_buffer::buffer_this_thread();
            prefixlb::server::yielding::woke();
        })
        .on_thread_park(move || {
            prefixlb::telemetry::log_buffer::flush_this_thread();
            if let Some(pins) = &pins {
                pins.pin_once();
            }
        })
        .build()
        .context("starting the tokio runtime")
}

/// Logs to stderr (`RUST_LOG` or `default_level`), and with `traces`, OpenTelemetry
/// spans to a collector; the exporter is returned to be flushed at exit.
fn init_logging(
    format: LogFormat,
    default_level: &str,
    traces: Option<&prefixlb::config::TracingConfig>,
) -> anyhow::Result<Option<prefixlb::telemetry::traces::Exporter>> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;

    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level))
        // Trace spans are for the exporter, not the log.
        .add_directive(
            format!("{}=off", prefixlb::telemetry::traces::TARGET)
                .parse()
                .context("the log filter")?,
        );
    // Colour only for a person at a terminal, never into a file or journald; without
    // it, fields are written by the cheaper `PlainFields` (the same text).
    let terminal = std::io::stderr().is_terminal();
    let log = tracing_subscriber::fmt::layer()
        .with_ansi(terminal)
        .with_timer(prefixlb::telemetry::log_time::SecondsKept)
        .with_writer(prefixlb::telemetry::log_buffer::Stderr);
    let log = match format {
        LogFormat::Text if terminal => log.boxed(),
        LogFormat::Text => log
            .fmt_fields(prefixlb::telemetry::log_fields::PlainFields)
            .boxed(),
        LogFormat::Json => log
            .json()
            .event_format(prefixlb::telemetry::log_json::JsonLines::default())
            .boxed(),
    };
    let (spans, exporter) = match traces {
        Some(config) => {
            let (layer, exporter) = prefixlb::telemetry::traces::layer(config)
                .context("starting the OpenTelemetry exporter ([tracing])")?;
            (Some(layer), Some(exporter))
        }
        None => (None, None),
    };
    // Without traces there is no span layer at all: a `None` layer answers "always"
    // for every callsite, which at `info` made each request's span live (made, looked
    // up, closed) though nothing records it: a sixth of a small request's instructions.
    let logged = tracing_subscriber::registry().with(log.with_filter(filter));
    match spans {
        Some(spans) => logged.with(spans).init(),
        None => logged.init(),
    }
    Ok(exporter)
}

/// The subcommands of the `tools` feature.
#[cfg(feature = "tools")]
mod tools {
    use std::net::SocketAddr;
    use std::path::{Path, PathBuf};
    use std::process::ExitCode;
    use std::time::Duration;

    use anyhow::Context;
    use clap::Args;

    use super::{emit, load, runtime};
    use prefixlb::tools::engine_model::Costs;
    use prefixlb::tools::mock_engine::{MockConfig, MockEngine, SglangRole};
    use prefixlb::tools::workload::{self, Workload};
    use prefixlb::tools::{bench as load_test, demo as demo_run, sim};

    #[derive(Args)]
    pub struct SimulateArgs {
        /// Routing settings for the `prefixlb` policy (and the pool's model name).
        #[arg(long)]
        config: PathBuf,
        /// A Mooncake JSON-lines trace.
        #[arg(long, conflicts_with = "workload")]
        trace: Option<PathBuf>,
        /// A synthetic workload: multi-turn, doc-qa, shared-prefix, rag, agentic,
        /// multi-tenant, long-preamble-N (any of them with -completions: as templated
        /// prompts; with -messages: over Anthropic's Messages API), or continuations[-VARIANT] (production-shaped prompt strings; see
        /// docs/evidence.md).
        #[arg(long)]
        workload: Option<String>,
        /// Policies to compare (comma-separated); default all (`prefixlb-fifo`, the
        /// queue served oldest first, only for a workload with tenants).
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// Engines (default: the config's first pool's node count).
        #[arg(long)]
        nodes: Option<usize>,
        /// KV-cache capacity per engine, in tokens.
        #[arg(long, default_value_t = 200_000)]
        cache_tokens: usize,
        /// Tokens per trace block.
        #[arg(long, default_value_t = 512)]
        block_tokens: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Multiplies the synthetic workload's number of conversations.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Also write the workload as a Mooncake trace to this file.
        #[arg(long)]
        write_trace: Option<PathBuf>,
        /// Balancer replicas for the `prefixlb` policy, each with its own state.
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// How requests are spread over the replicas: round-robin or random.
        #[arg(long, value_enum, default_value_t = SpreadArg::RoundRobin)]
        spread: SpreadArg,
        /// Replicas see each other's in-flight requests per engine at every decision
        /// (no lag): the upper bound of any load sharing between replicas.
        #[arg(long)]
        share_load: bool,
        /// With --share-load: what the replicas see is a snapshot taken every MS of
        /// virtual time (a feed through heartbeats), not the count of the moment.
        #[arg(long, value_name = "MS", requires = "share_load")]
        share_every_ms: Option<u64>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    }

    #[derive(Clone, Copy, clap::ValueEnum)]
    pub enum SpreadArg {
        RoundRobin,
        Random,
    }

    #[derive(Args)]
    pub struct BenchArgs {
        /// Base URL, e.g. http://127.0.0.1:8080 (repeat to round-robin over several).
        #[arg(long, required = true)]
        target: Vec<String>,
        /// multi-turn, shared-prefix, rag, agentic, multi-tenant, doc-qa, long-preamble-N,
        /// continuations[-VARIANT] (each request a /v1/completions prompt).
        #[arg(long, required_unless_present = "trace")]
        workload: Option<String>,
        /// A Mooncake JSON-lines trace instead: each request is sent as an untemplated
        /// /v1/completions prompt of its blocks as text, in trace order (pace with
        /// --rate).
        #[arg(long, conflicts_with = "workload")]
        trace: Option<PathBuf>,
        /// Tokens per trace block.
        #[arg(long, default_value_t = 512)]
        block_tokens: usize,
        /// Requests in flight (closed loop).
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        /// Requests per second (open loop) instead of a closed loop.
        #[arg(long)]
        rate: Option<f64>,
        /// Stop after this many requests (default: the whole workload).
        #[arg(long)]
        requests: Option<usize>,
        /// Stream responses (TTFT = first content event).
        #[arg(long)]
        stream: bool,
        /// The `model` to send.
        #[arg(long, default_value = "mock")]
        model: String,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Multiplies the workload's number of conversations.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// Caps every answer's `max_tokens` (small CPU engines decode slowly).
        #[arg(long)]
        max_tokens: Option<usize>,
        /// Send each conversation's id (`conv-N`) in this header, as the client of a
        /// session-keyed router does (e.g. x-session-id).
        #[arg(long)]
        session_header: Option<http::HeaderName>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    }

    #[derive(Args)]
    pub struct MockEngineArgs {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long, default_value = "mock")]
        id: String,
        #[arg(long, default_value = "mock")]
        model: String,
        /// Prefill cost per uncached prompt token, in µs.
        #[arg(long, default_value_t = 100)]
        prefill_us_per_token: u64,
        /// Decode cost per output token, in ms.
        #[arg(long, default_value_t = 10)]
        decode_ms_per_token: u64,
        /// Extra decode time per token for each other running sequence, as a share of
        /// the decode cost.
        #[arg(long, default_value_t = 0.02)]
        batch_slowdown: f64,
        /// KV-cache capacity in tokens.
        #[arg(long, default_value_t = 200_000)]
        cache_tokens: usize,
        /// Sequences running at once; more wait.
        #[arg(long, default_value_t = 64)]
        max_num_seqs: usize,
        /// Context window in tokens (prompt + output); longer requests get a 400 like
        /// vLLM's. 0 = unlimited.
        #[arg(long, default_value_t = 0)]
        max_model_len: usize,
        /// LoRA adapters served beside the model (comma-separated): listed by
        /// `/v1/models` with the model as `parent`, as vLLM lists them; with any, a
        /// request for a model not served gets vLLM's 404.
        #[arg(long, value_delimiter = ',')]
        adapters: Vec<String>,
        /// Answer `/v1/embeddings` with a 501, as llama.cpp's server started without
        /// `--embeddings` does. (Chat messages with an image part always get
        /// llama.cpp's 500 for a text-only model.)
        #[arg(long)]
        no_embeddings: bool,
        /// Data-parallel ranks, each with its own KV cache and prefill lane, as vLLM
        /// `--data-parallel-size` runs behind one URL: a request names its rank in
        /// `x-data-parallel-rank` (or SGLang's `x-override-routed-dp-rank`), else the
        /// ranks take requests in turn.
        #[arg(long, default_value_t = 1)]
        data_parallel_size: usize,
        /// SGLang's disaggregated serving (`--disaggregation-mode`): `prefill` keeps each
        /// request's KV cache under its `bootstrap_room` (served at `GET
        /// /mock/bootstrap/{room}` on this port); `decode` pulls it from the
        /// `bootstrap_host` and `bootstrap_port` its request names (waiting for it a
        /// few seconds, then SGLang's error) and prefills nothing.
        #[arg(long, value_parser = ["prefill", "decode"])]
        disaggregation_mode: Option<String>,
    }

    /// The workload of `simulate` and `bench`: a Mooncake trace file or a synthetic one.
    fn load_workload(
        name: Option<&str>,
        trace: Option<&Path>,
        block_tokens: usize,
        seed: u64,
        scale: f64,
    ) -> anyhow::Result<Workload> {
        match (trace, name) {
            (Some(path), _) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading trace {}", path.display()))?;
                workload::trace(&text, block_tokens).map_err(anyhow::Error::msg)
            }
            (None, Some(name)) => workload::synthetic(name, seed, scale).with_context(|| {
                format!(
                    "unknown workload {name:?} (one of {}, {}; `-completions` or `-messages` after any of the first)",
                    workload::NAMES.join(", "),
                    workload::continuations::NAMES.join(", ")
                )
            }),
            (None, None) => anyhow::bail!("give --trace FILE or --workload NAME"),
        }
    }

    pub fn simulate(a: SimulateArgs) -> anyhow::Result<ExitCode> {
        let Some(config) = load(&a.config) else {
            return Ok(ExitCode::from(2));
        };
        let w = load_workload(
            a.workload.as_deref(),
            a.trace.as_deref(),
            a.block_tokens,
            a.seed,
            a.scale,
        )?;
        if let Some(path) = a.write_trace {
            std::fs::write(&path, workload::to_trace(&w))?;
        }
        let mut fleet = sim::Fleet::of(
            a.nodes.unwrap_or(config.pools[0].nodes.len()).max(1),
            a.cache_tokens,
        );
        fleet.replicas = a.replicas.max(1);
        fleet.share_load = a.share_load;
        fleet.share_every_us = a.share_every_ms.unwrap_or(0).saturating_mul(1000);
        fleet.spread = match a.spread {
            SpreadArg::RoundRobin => sim::Spread::RoundRobin,
            SpreadArg::Random => sim::Spread::Random,
        };
        let policies: Vec<String> = if a.policies.is_empty() {
            // prefixlb-fifo differs from prefixlb only where the workload names tenants.
            let tenants = w.conversations.iter().any(|c| c.tenant.is_some());
            sim::POLICIES
                .iter()
                .filter(|p| tenants || **p != "prefixlb-fifo")
                .map(|p| p.to_string())
                .collect()
        } else {
            a.policies
        };
        let reports = policies
            .iter()
            .map(|p| sim::simulate(&w, &config, &fleet, p).map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<Vec<_>>>()?;
        if a.json {
            let json = serde_json::json!({ "policies": reports });
            return emit(format!("{}\n", serde_json::to_string_pretty(&json)?))
                .map(|()| ExitCode::SUCCESS);
        }
        emit(format!(
            "workload {} ({} requests) on {} engines, {} cached tokens each{}\n\n",
            w.name,
            w.requests(),
            fleet.nodes,
            fleet.cache_tokens,
            match fleet.replicas {
                1 => String::new(),
                n => format!(", {n} balancer replicas"),
            }
        ))?;
        emit(sim::table(&reports))?;
        Ok(ExitCode::SUCCESS)
    }

    pub fn bench(a: BenchArgs) -> anyhow::Result<ExitCode> {
        let w = load_workload(
            a.workload.as_deref(),
            a.trace.as_deref(),
            a.block_tokens,
            a.seed,
            a.scale,
        )?;
        let opts = load_test::BenchOptions {
            targets: a.target,
            model: a.model,
            concurrency: a.concurrency,
            rate: a.rate,
            requests: a.requests,
            stream: a.stream,
            progress: !a.json,
            session_header: a.session_header,
        };
        let mut scripts = load_test::Script::from_workload(&w);
        if let Some(cap) = a.max_tokens {
            for t in scripts.iter_mut().flat_map(|s| s.turns.iter_mut()) {
                t.max_tokens = t.max_tokens.min(cap.max(1));
            }
        }
        let report = runtime()?.block_on(load_test::run(scripts, &opts));
        if a.json {
            emit(format!("{}\n", serde_json::to_string_pretty(&report)?))?;
        } else {
            emit(report.table())?;
        }
        Ok(ExitCode::SUCCESS)
    }

    pub fn demo() -> anyhow::Result<ExitCode> {
        let report = runtime()?.block_on(demo_run::run())?;
        emit(report)?;
        Ok(ExitCode::SUCCESS)
    }

    pub fn mock_engine(a: MockEngineArgs) -> anyhow::Result<ExitCode> {
        let config = MockConfig {
            id: a.id.clone(),
            model: a.model,
            costs: Costs {
                prefill_per_token: Duration::from_micros(a.prefill_us_per_token),
                decode_per_token: Duration::from_millis(a.decode_ms_per_token),
                batch_slowdown: a.batch_slowdown,
            },
            cache_tokens: a.cache_tokens,
            max_num_seqs: a.max_num_seqs,
            max_model_len: a.max_model_len,
            adapters: a.adapters,
            no_embeddings: a.no_embeddings,
            data_parallel_size: a.data_parallel_size,
            disaggregation_mode: a.disaggregation_mode.as_deref().map(|m| match m {
                "prefill" => SglangRole::Prefill,
                _ => SglangRole::Decode,
            }),
        };
        let listen = a.listen;
        runtime()?.block_on(async move {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("cannot bind {listen}"))?;
            println!(
                "mock-engine {} listening on http://{}",
                a.id,
                listener.local_addr()?
            );
            MockEngine::new(config)
                .serve(listener, prefixlb::server::listener::termination())
                .await;
            anyhow::Ok(())
        })?;
        Ok(ExitCode::SUCCESS)
    }
}
