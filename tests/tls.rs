//! TLS with rustls: HTTPS on the client listener with its certificate re-read on reload,
//! `https://` replicas checked against the configured CA, and agents reporting to an HTTPS
//! admin listener. Certificates are made for each test by a throwaway CA.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A CA and a certificate it signed for `localhost` and 127.0.0.1, as PEM files in `dir`.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn pki(dir: &Path, name: &str) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    std::fs::create_dir_all(dir).unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf_params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = leaf_params.signed_by(&leaf_key, &ca, &ca_key).unwrap();
    let write = |file: &str, pem: String| {
        let path = dir.join(format!("{name}-{file}"));
        std::fs::write(&path, pem).unwrap();
        path
    };
    Pki {
        ca: write("ca.pem", ca.pem()),
        cert: write("cert.pem", leaf.pem()),
        key: write("key.pem", leaf_key.serialize_pem()),
    }
}

fn scratch(test: &str) -> tempfile::TempDir {
    temp_dir(&format!("tls-{test}"))
}

/// A client that trusts only `ca`.
fn trusting(ca: &Path) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(&std::fs::read(ca).unwrap()).unwrap();
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(ca)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Starts a gateway from `yaml` and waits until `url/health` answers through `client`.
async fn start_gateway(
    yaml: &str,
    name: &str,
    client: &reqwest::Client,
    url: &str,
) -> (Proc, tempfile::TempPath) {
    let config = temp_file_with(name, ".yaml", yaml);
    let mut cmd = kvgate();
    cmd.args(["gateway", "--config", config.to_str().unwrap()]);
    let proc = spawn(cmd, name);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status().is_success() {
                return (proc, config);
            }
        }
        assert!(Instant::now() < deadline, "{url} never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn tls_yaml(port: u16, admin: u16, pki: &Pki, replicas: &str) -> String {
    format!(
        "listen: \"127.0.0.1:{port}\"\nadmin_listen: \"127.0.0.1:{admin}\"\ntls:\n  cert_file: \"{}\"\n  key_file: \"{}\"\nreplicas:\n{replicas}",
        pki.cert.display(),
        pki.key.display()
    )
}

async fn complete(client: &reqwest::Client, url: &str) -> Result<u16, reqwest::Error> {
    client
        .post(format!("{url}/v1/completions"))
        .json(&completion("over tls", false))
        .send()
        .await
        .map(|r| r.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_serves_https_and_takes_a_new_certificate_on_reload() {
    let dir = scratch("listener");
    let (first, second) = (pki(dir.path(), "first"), pki(dir.path(), "second"));
    let w = Worker::start(&[]).await;
    let (port, admin) = (free_port(), free_port());
    let url = format!("https://localhost:{port}");
    let replicas = format!("  - url: \"{}\"\n", w.url());
    let (gw, config) = start_gateway(
        &tls_yaml(port, admin, &first, &replicas),
        "tls-listener",
        &trusting(&first.ca),
        &url,
    )
    .await;
    assert_eq!(complete(&trusting(&first.ca), &url).await.unwrap(), 200);
    assert!(
        complete(&trusting(&second.ca), &url).await.is_err(),
        "an unknown CA was trusted"
    );
    assert!(
        complete(&client(), &format!("http://127.0.0.1:{port}"))
            .await
            .map_or(true, |s| s != 200),
        "plain HTTP answered on the TLS port"
    );

    // The second certificate into the same files, then a reload: new connections get it.
    std::fs::copy(&second.cert, &first.cert).unwrap();
    std::fs::copy(&second.key, &first.key).unwrap();
    gw.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while complete(&trusting(&second.ca), &url).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the new certificate was not taken"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(complete(&trusting(&first.ca), &url).await.is_err());

    // A broken key is refused by the reload; the certificate in use stays.
    std::fs::write(&first.key, "not a key").unwrap();
    let r = trusting(&second.ca)
        .post(format!("https://localhost:{admin}/admin/reload"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body = r.text().await.unwrap();
    assert!(body.contains("tls"), "{body}");
    assert_eq!(complete(&trusting(&second.ca), &url).await.unwrap(), 200);
    drop(config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_replicas_are_checked_against_the_configured_ca() {
    let dir = scratch("upstream");
    let (served, other) = (pki(dir.path(), "served"), pki(dir.path(), "other"));
    let w = Worker::start(&[]).await;
    // An HTTPS replica: a TLS gateway in front of the test worker.
    let (inner_port, inner_admin) = (free_port(), free_port());
    let inner_url = format!("https://localhost:{inner_port}");
    let replicas = format!("  - url: \"{}\"\n", w.url());
    let (_inner, _) = start_gateway(
        &tls_yaml(inner_port, inner_admin, &served, &replicas),
        "tls-inner",
        &trusting(&served.ca),
        &inner_url,
    )
    .await;

    for (ca, name, ok) in [
        (&served.ca, "tls-outer-good", true),
        (&other.ca, "tls-outer-bad", false),
    ] {
        let (port, admin) = (free_port(), free_port());
        let yaml = format!(
            "listen: \"127.0.0.1:{port}\"\nadmin_listen: \"127.0.0.1:{admin}\"\nupstream_ca_file: \"{}\"\nretries: {{attempts: 1}}\nreplicas:\n  - url: \"{inner_url}\"\n    models: [\"{MODEL}\"]\n",
            ca.display()
        );
        let url = format!("http://127.0.0.1:{port}");
        let (_outer, _) = start_gateway(&yaml, name, &client(), &url).await;
        let status = complete(&client(), &url).await.unwrap();
        if ok {
            assert_eq!(status, 200, "through the HTTPS replica");
        } else {
            assert!(
                status >= 500,
                "a replica with an untrusted certificate answered: {status}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_report_to_an_https_admin_listener() {
    let dir = scratch("agents");
    let p = pki(dir.path(), "admin");
    let w = SimWorker::start(&["--time-scale", "0.01"]).await;
    let token = dir.path().join("agent-token");
    std::fs::write(&token, "s3cret-agent-token").unwrap();
    let (port, admin) = (free_port(), free_port());
    let replicas = format!(
        "  - url: \"{}\"\n    id: \"{}\"\nagents:\n  token_file: \"{}\"\n",
        w.url(),
        Upstream::id(&w),
        token.display()
    );
    let url = format!("https://localhost:{port}");
    let admin_url = format!("https://localhost:{admin}");
    let tls_client = trusting(&p.ca);
    let (_gw, _) = start_gateway(
        &tls_yaml(port, admin, &p, &replicas),
        "tls-agents",
        &tls_client,
        &url,
    )
    .await;
    let mut cmd = kvgate();
    cmd.args(["agent", "--gateway", &admin_url, "--token-file"])
        .arg(&token)
        .arg("--ca-file")
        .arg(&p.ca)
        .args(["--url", &w.url(), "--replica-id", &Upstream::id(&w)]);
    let _agent = spawn(cmd, "tls-agent");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v: serde_json::Value = tls_client
            .get(format!("{admin_url}/admin/replicas"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if v["replicas"][0]["freshness"] == "fresh" {
            break;
        }
        assert!(Instant::now() < deadline, "no report over TLS: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
