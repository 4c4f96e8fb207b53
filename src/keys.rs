//! Secrets for the command line: `kvgate hash-key` (an API key's hash for a tenant's
//! `api_keys`), and random tokens for new keys and `kvgate up`.

use std::io::BufRead;

/// 32 random bytes from the operating system, as 64 hex digits.
pub fn random_token() -> Result<String, String> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| format!("no randomness from the system: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// `kvgate hash-key`: the hash of the key on standard input (its first line; a key on the
/// command line would be visible to every user of the machine), or with `generate` a new
/// key on the first line of output and its hash on the second.
pub fn hash_key(generate: bool) -> Result<(), String> {
    if generate {
        let key = format!("sk-kvgate-{}", random_token()?);
        println!("{key}\n{}", kvgate_router::hash_api_key(key.as_bytes()));
        return Ok(());
    }
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .map_err(|e| format!("cannot read the key from standard input: {e}"))?;
    let key = line.trim();
    if key.is_empty() {
        return Err("no key on standard input (or use --generate)".into());
    }
    println!("{}", kvgate_router::hash_api_key(key.as_bytes()));
    Ok(())
}
